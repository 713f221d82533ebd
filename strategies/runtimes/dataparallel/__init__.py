"""Data parallelism without parameter servers: ``allreduce`` (torch's DDP, dense and with
row-sparse gradients), its helpers ``ddp`` (find_unused_parameters and the unused-parameter
error), ``sparse_allgather`` (Horovod's padded AllGather of sparse gradients, for NCCL; which
optimizers take sparse gradients is strategies/job/optimizer_rules.py), and ``fsdp`` (torch's FSDP2, ``fully_shard``). hybrid/ reuses the DDP helpers for its
dense part.
"""
