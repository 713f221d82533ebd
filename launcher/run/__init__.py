"""``hpar run`` from a resolved configuration to a summary, on the hosts and processes side (the
plan-stage checks and settings are strategies/plan/): ``cluster_build`` (the cluster from the
flags), ``plan_run`` (profile and choose a plan), ``device_choice`` (each host's device from
what it sees), ``runner`` (place processes, write the run directory, start, restart),
``supervisor`` (read every process's output, stop all at the first failure), ``teardown`` (stop
every group, one command per host, all hosts at once), ``progress`` (live view or plain lines),
``rundir`` (config, logs, metrics, summary), ``rendezvous`` (a MASTER_PORT no other run can
take), ``elastic`` and ``reshape`` (restarts and resume at another size); ``scripts`` runs
``hpar launch``'s torchrun-style scripts the same way."""
