"""Balanced pipeline model parallelism (SpecTrain): the ``pipeline`` runtime and its peers.

Chen et al., "Efficient and Robust Parallel DNN Training through Model Parallelism on
Multi-GPU Platform" (SpecTrain, arXiv:1809.02839): stages of equal cost, 1F1B, and weight
prediction against the staleness of asynchronous pipelining. Stage balancing follows
PipeDream's planner (Narayanan et al., SOSP 2019); GPipe (Huang et al., NeurIPS 2019) is the
synchronous baseline.

- The plan's side (strategies/plan/): ``partition`` (contiguous layers into K stages of equal
  cost, dynamic programming), ``schedules`` (each stage's order of forward and backward
  passes: GPipe, 1F1B, async), ``stage_cuts`` (where the model is cut; what a run can take)
  and ``pipeline_grid`` (K stages x R replicas).
- ``stage``: one stage's layers and passes, independent of how tensors travel.
- ``prediction``: which weights a pass uses: live, stashed (PipeDream) or predicted (SpecTrain).
  or one version old (PipeDream-2BW).
- ``velocity``: the optimizer's update direction that prediction extrapolates (SGD, Adam, AdamW).
- ``divergence``: the divergence guard of asynchronous runs (stop, or fall back to 1F1B).
- ``comm``: point-to-point links between neighbour stages (torch.distributed send/recv).
- ``runtime``: one process per stage running its schedule, in the training spine with
  ``stage_step`` (one batch of the stage's passes, the divergence guard, the step's end).
- ``sim``: the same schedules in one process (a reference for tests and benchmarks).
- ``torch_peers``: torch.distributed.pipelining's schedules on the same stages, for comparison.

May import the folders before runtimes/ and torch; never
``hpar.launcher`` or ``hpar.workers``.
"""
