"""Hybrid data parallelism (Parallax) and its parameter server: the ``hybrid`` and ``ps`` runtimes.

Kim et al., "Parallax: Sparsity-aware Data Parallel Training of Deep Neural Networks",
EuroSys 2019: sparse parameters live on sharded parameter servers (pull the touched rows,
push sparse gradients), dense ones are averaged with AllReduce.

- ``runtime``: the worker's set-up for ``hybrid`` and ``ps`` (DDP for the dense part), trained
  by the training spine with ``worker_step`` (one step: pulls, pushes, the dense update) and
  ``worker_state`` (its checkpoints and evaluate()'s model copy).
- ``embedding``: serves the user's nn.Embedding / nn.EmbeddingBag from the servers, unchanged.
- ``client``: the worker side of pull and push (which parameter is served, and with which
  rule, is strategies/plan/placement.py).
- ``shard``: the server side: row partitions of a table and their sparse optimizers.
- ``server``: a parameter server's shards and the loop that answers the workers
  (``hpar.workers.server`` is the process around it).
- ``wire``: the one-message-per-request protocol between them (gloo point-to-point).
- ``ahead``: rows requested before the lookup that needs them.

May import the folders before runtimes/, dataparallel/ and torch; never
``hpar.launcher`` or ``hpar.workers``.
"""
