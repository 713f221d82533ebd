"""``hpar run`` from a resolved configuration to a summary: ``planning`` (profile and choose a
plan), ``devices`` (each host's device from what it sees), ``runner`` (place processes, write the run directory, start, restart), ``supervisor``
(read every process's output, stop all at the first failure), ``teardown`` (stop every group,
one command per host, all hosts at once), ``progress`` (live view or
plain lines), ``rundir`` (config, logs, metrics, summary), ``rendezvous`` (a MASTER_PORT no
other run can take), ``strategy_settings`` (what depends on the strategy: DDP's
find_unused_parameters, default micro-batches, whether the optimizer can step); ``scripts`` runs ``hpar launch``'s torchrun-style scripts the same way."""
