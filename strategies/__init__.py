"""Everything that knows about training math, in subpackages that name the flow::

    common/job (load the user's script) -> profile/ (measure) -> plan/ (decide) -> a runtime
    in every process: dataparallel/ (DDP, FSDP), hybrid/ (Parallax), pipeline/ (SpecTrain)

What each strategy is (its needs, checks, cost and memory model, runtime) is its spec in
specs/, read through specs/registry.py by everything above.

Shared by the runtimes: common/ (the job, the run's config, the worker's context and meters,
the training loop, devices, process groups, memory, phase activity, the first batch), models/
(how the user's model is called, cut into layers, traced, tied; Hugging Face models) and
runstate/ (checkpoints and the trained model with torch.distributed.checkpoint, export).
Nothing here imports ``hpar.launcher`` or ``hpar.workers``.
"""
