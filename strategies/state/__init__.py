"""A run's state on disk: ``checkpoint`` (the run directory's step layout, ``latest``, crash-safe
files and checksums), ``state`` (every process writes what it holds with
torch.distributed.checkpoint: checkpoints and the trained model) and ``export`` (the trained
model as one torch file, safetensors or a ``save_pretrained`` directory).
"""
