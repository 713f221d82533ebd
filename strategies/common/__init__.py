"""What every runtime and process of a run shares: ``job`` (the user-script contract),
``config`` (the resolved run configuration), ``context`` (what a runtime gets and returns, the
step and byte meters), ``loop`` (the training loop's tools: autocast, clipping, accumulation,
schedules, evaluation), ``spine`` (the one training loop, with a step object per strategy),
``devices`` (what moves between host and device, CUDA-event timing), ``groups`` (which process
group, gloo or NCCL, carries what), ``memory`` (measured peak memory), ``activity`` (what a
process is busy with outside the steps, for the launcher's phase deadline) and ``first_batch``
(a worker's first batch: drawn within that deadline, checked before training).
"""
