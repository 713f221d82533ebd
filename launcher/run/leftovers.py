"""What the launcher's own calls of the user's code left running, ended when ``hpar`` exits.

``hpar run`` and ``hpar profile`` import the script and call its ``model()`` and ``data()`` in
the launcher process before any worker starts (the pre-start checks, the profile, the
find_unused probe). A ``data()`` that starts a helper in a session of its own
(``subprocess.Popen(..., start_new_session=True)``) leaves it as the launcher's child, outside
every group the teardown stops; it would outlive ``hpar``. The workers' own such helpers are
their guards' to end (workers/guard.py, launcher/procs/local.py, workers/stopgroups.py). At exit
the launcher ends its own descendants that left its process group (workers/descendants.py; by
then every process it started for the run has been stopped), and says which in one line.
"""

from __future__ import annotations

import contextlib
import os

from hpar.workers.descendants import end, ended_line, outside_group


@contextlib.contextmanager
def ended_at_exit(say):
    """Run the block (a command); afterwards, however it ends, end the launcher's descendants
    outside its process group and ``say`` the line naming them (nothing when there are none)."""
    try:
        yield
    finally:
        left = outside_group(os.getpid(), os.getpgrp())
        line = ended_line({"started by the script in the launcher (its checks, the profile)": end(left)})
        if line:
            say(line)
