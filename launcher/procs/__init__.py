"""One process of a run, wherever it runs: ``local`` (ProcessSpec, LocalProcess: a guarded
child in its own session on this machine) and ``ssh`` (RemoteProcess over fabric, with the
same methods). The launcher only ever signals the process groups recorded here."""
