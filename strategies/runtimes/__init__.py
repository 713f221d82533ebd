"""The runtimes, the last stage of the flow: what runs in every worker and server process.

- ``spine``: the one training loop every strategy shares (first evaluation, step timing and
  memory windows, accumulation, clipping, schedule, logging, evaluation every N steps,
  checkpoint timing, the final write), with a step object per strategy.
- ``dataparallel/``: ``allreduce`` and ``allreduce-sparse`` (torch's DDP, its comm hooks) and
  ``fsdp`` (FSDP2).
- ``hybrid/``: Parallax's ``hybrid`` and ``ps`` (parameter servers beside AllReduce).
- ``pipeline/``: SpecTrain's balanced pipelines (1F1B, weight prediction) and
  torch.distributed.pipelining's schedules as peers.
- ``torchrec/``: TorchRec's sharded embeddings as a peer strategy.

Each runtime's spec (strategies/specs/) names its entry point ``train(ctx)``. May import every
folder before it (specs, common, job, state, profile, plan); never ``hpar.launcher``.
"""
