"""Process entry points only: ``python -m hpar.workers.worker`` (a training rank),
``... .server`` (a parameter server), ``... .guard`` (keeps either from outliving the
launcher), ``... .stopgroups`` (the teardown's one command per host), ``report`` (tagged JSON lines to the launcher),
``descendants`` (what those processes started in sessions of their own, and ending it). They read the environment and the
run's config.json and call into ``hpar.strategies``: no training math, no SSH."""
