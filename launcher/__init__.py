"""Everything that knows about hosts, SSH and processes; no training math.

- ``cli``: the ``hpar`` command group; ``commands/``: one module per subcommand (run,
  profile, bench) turning flags into a resolved configuration.
- ``hosts/``: host files and ``--hosts`` lists, the parallel preflight, SSH options.
- ``procs/``: starting, reading and stopping one process, locally or over SSH.
- ``run/``: one run from start to summary: placement, run directory, supervisor (first
  failure stops everything), live progress, restarts.
- ``bench/``: ``hpar bench``'s driver, its report and the emulated cluster.

May import ``hpar.strategies`` (to load the job, profile and plan before anything starts);
``hpar.workers`` only by module name, as the command a process runs.
"""
