"""The hosts of a run: ``hostfile`` parses host files, inline lists and the ``HxG`` shorthand
and places ranks on hosts; ``preflight`` checks every host in parallel before anything
starts; ``remote`` turns ``hpar run``'s SSH flags into options and refuses failing hosts;
``slurm`` reads the hosts and slots of a Slurm allocation; ``emulated`` parses ``--hosts
emulate:H`` (launcher/bench/emulate.py builds those hosts); ``environ`` is the allowlist of
variables remote processes get (plus ``--env``)."""
