"""``--strategy torchrec``: the user's embedding tables as one-table TorchRec collections
(``trec_tables``), sharded by DistributedModelParallel with the script's optimizer fused into
their backward (``trec_shard``, ``trec_optim``), trained in the training spine
(``trec_runtime``); ``trec_check`` refuses, before start, what cannot run (TorchRec missing or
built for another torch, tables or optimizers its kernels lack). TorchRec is imported only on
this path.
"""
