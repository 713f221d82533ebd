"""One process of a run, wherever it runs: ``local`` (ProcessSpec, LocalProcess: a guarded
child in its own session on this machine), ``ssh`` (RemoteProcess over fabric, with the
same methods; ``ssh_pool``: one shared connection per host; ``ssh_control``: commands in
channels of it) and ``srun`` (SrunProcess: a task of the run's one srun step in a Slurm
allocation, same methods). The launcher only ever signals the process groups recorded here."""
