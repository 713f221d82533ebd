"""One module per ``hpar`` subcommand: ``run`` (flags, HPAR defaults, plan or planner, hosts
-> RunConfig), ``profile`` (measure, predict, print the plan), ``bench`` (compare strategies),
``launch`` (any torchrun-style script, unprofiled).
Each checks everything it can before a process starts and raises ValueError (one line) for
user errors; ``launcher/cli.py`` turns those into exit code 2."""
