"""Everything that knows about training math, in subpackages that name the flow::

    job (load the user's script) -> profile/ (measure) -> plan/ (decide) -> a runtime in
    every process: allreduce (DDP), hybrid/ (Parallax), pipeline/ (SpecTrain)

Shared by every runtime: ``job`` (the user-script contract), ``config`` (the resolved run
configuration), ``context`` (what a runtime gets and returns, the step and byte meters),
``checkpoint`` (crash-safe files), ``layers`` (the one definition of the model's layers),
``tying`` (shared parameters, which embedding tables are row-sparse), ``groups`` (which
process group, gloo or NCCL, carries what), ``devices`` (what moves between host and device,
CUDA-event timing), ``sparse_allgather`` (Horovod's padded AllGather of sparse gradients, for
NCCL), ``allreduce`` (the DDP runtime, whose helpers hybrid reuses for its dense part), ``ddp``
(DDP's find_unused_parameters and its unused-parameter error, for both) and ``sparse_grads``
(which optimizers take sparse gradients; the others' made dense before the step), ``activity``
(what a process is busy with outside the steps, for the launcher's phase deadline) and
``first_batch`` (a worker's first batch: drawn within that deadline, checked before training).
Nothing here imports ``hpar.launcher`` or ``hpar.workers``.
"""
