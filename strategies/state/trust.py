"""Which run directories hpar trusts, writes into and cleans: its own, and nobody else's.

A run directory names code (its ``config.json`` names the script every worker imports) and
holds pickles' worth of state, so whoever can write it can run code as the user who runs or
resumes it. hpar therefore:

- creates a new run directory mode 0700 (0750 with ``--group-readable``: a group may read it,
  never write it) and writes a marker file, ``.hpar-run``, into it at once;
- refuses (one line, exit 2) a run directory, or any file or folder in it, that is not owned
  by the current user or that group or others may write (the test of OpenSSH's
  ``StrictModes``, sshd(8) FILES, applied to the run directory instead of ``~/.ssh``); a
  directory's owner can replace any file in it, so a file's own mode is not enough;
- refuses a non-empty ``--run-dir`` without the marker (a folder of something else: hpar
  would otherwise mix its files into it and clean up beside them); ``--resume`` of a run
  written before markers existed adopts it (the user named it as a run);
- deletes only its own paths inside a marked run (checkpoint.py ``remove_temp_files``,
  ``remove_incomplete_steps``).

Checks are of the directory tree as it is (``lstat``: a symbolic link is judged as a link,
never followed). Source: OpenSSH sshd(8) and sshd_config(5) ``StrictModes``; the facts in
the security notes beside this project.
"""

from __future__ import annotations

import os
import pwd
import stat

MARKER = ".hpar-run"
_MARKER_TEXT = b"hpar run directory: hpar wrote the files here and may clean up its own temp files\n"


def is_marked(path: str) -> bool:
    """Whether ``path`` holds hpar's marker (a regular file, not a link)."""
    try:
        return stat.S_ISREG(os.lstat(os.path.join(path, MARKER)).st_mode)
    except OSError:
        return False


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def problem(path: str) -> str | None:
    """Why ``path`` (one entry, not followed when a link) is not trusted, or None: it must be
    owned by this process's effective user and, unless a link, not writable by group or
    others."""
    st = os.lstat(path)
    if st.st_uid != os.geteuid():
        return f"owned by {_owner(st.st_uid)}, not by you ({_owner(os.geteuid())})"
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if st.st_mode & bit)
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_trusted(path: str, flag: str = "--run-dir") -> None:
    """ValueError (one line naming the first offending path and the fix) unless ``path`` and
    everything in it pass :func:`problem`. A missing ``path`` passes (nothing to trust yet).
    Cost: one ``lstat`` per entry."""
    if not os.path.lexists(path):
        return
    entries = [path]
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            entries += [os.path.join(root, n) for n in dirs + files]
    for entry in entries:
        why = problem(entry)
        if why is not None:
            fix = f"chmod go-w {entry}" if why.startswith("writable") else "use a run directory of your own"
            raise ValueError(
                f"{flag} {path}: {entry} is {why}; a run directory names code that hpar runs, so hpar "
                f"trusts only one that only you can write ({fix})"
            )


def check_unmarked(path: str, flag: str = "--run-dir") -> None:
    """ValueError unless ``path`` is absent, an empty directory or a marked run directory:
    hpar writes and cleans up only in folders it made."""
    if os.path.isdir(path) and not is_marked(path) and os.listdir(path):
        raise ValueError(
            f"{flag} {path}: the folder holds files hpar did not write (no {MARKER} marker in it); "
            "pick a new or empty directory (hpar never writes or cleans up beside others' files)"
        )


def claim(path: str, group_readable: bool = False, adopt: bool = False) -> None:
    """Make ``path`` this user's marked run directory: create it (and its parents) with mode
    0700, or 0750 when ``group_readable``, or take an existing empty or already marked
    directory; ``adopt`` also takes an unmarked one (a run being resumed). The marker is
    written at once. Raises ValueError as :func:`check_trusted` and :func:`check_unmarked`."""
    mode = 0o750 if group_readable else 0o700
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            os.mkdir(path, mode)
            os.chmod(path, mode)  # the umask may have taken bits the mode asked for (never adds any)
        except FileExistsError:
            pass  # made at this moment by someone else: judged below like any existing folder
    check_trusted(path)
    if not adopt:
        check_unmarked(path)
    if not is_marked(path):
        fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_MARKER_TEXT)


__all__ = ["MARKER", "is_marked", "problem", "check_trusted", "check_unmarked", "claim"]
