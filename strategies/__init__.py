"""Everything that knows about training math, in folders that name the flow from the user's
script to a running strategy::

    job/ (the script, its model and optimizer, the run's config)
      -> profile/ (measure the model on the workers' device)
      -> plan/ (decide: cost and memory models, planner, placement, stage cuts, checks, fit)
      -> runtimes/ (train, in every process: dataparallel/, hybrid/, pipeline/, torchrec/ and
         the one training spine)

Read by all of them: specs/ (what each strategy is, the shape of a plan, the values a runtime
and its models share), common/ (devices, process groups, measured memory, phase activity) and
state/ (the files a run writes: checkpoints, the trained model, export). A folder imports only
the folders before it in this order (specs, common, job, state, profile, plan, runtimes;
tests/test_import_graph.py), and nothing here imports ``hpar.launcher`` or ``hpar.workers``.
"""
