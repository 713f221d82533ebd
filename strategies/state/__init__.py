"""A run's files: ``checkpoint`` (the run directory's step layout, ``latest``, crash-safe files
and checksums), ``state`` (every process writes what it holds with
torch.distributed.checkpoint: checkpoints and the trained model), ``safe_read``, ``trust`` and
``aliases`` (what hpar reads back, and from which directories), ``hf_save`` (a Hugging Face
model's ``save_pretrained`` directory) and ``export_files`` (the trained model as one torch
file, safetensors or a ``save_pretrained`` directory). May import specs/, common/ and job/.
"""
