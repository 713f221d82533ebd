"""The user's model as hpar sees it: ``forward`` (how a batch is fed: ``model(x)`` or
``model(**batch)``, through DDP and torch.compile wrappers), ``layers`` (the one definition of
a model's layers), ``traced`` (models that are not a sequence, cut by
torch.distributed.pipelining's tracer), ``tying`` (shared parameters, which embedding tables
are row-sparse) and ``hf`` (Hugging Face ``transformers`` models: ``save_pretrained``).
"""
