"""Hugging Face interop: a run whose model is a ``transformers.PreTrainedModel`` leaves its
trained weights in HF's own format, so that ``AutoModel...from_pretrained(RUN_DIR/"hf")``
(or the model class's) loads them with no conversion code.

``save_pretrained`` writes ``config.json`` and ``model.safetensors`` (``transformers`` 5 always
writes safetensors, and leaves a tied ``lm_head`` out: ``from_pretrained`` ties it again). It is
written into a temp directory beside the target and renamed into place, so a run killed
while writing leaves no half directory (an old one is replaced only once the new is whole).
``transformers`` is only imported when the user's script already did (it is an optional
extra: ``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from torch import nn

from hpar.strategies.job.forward import inner_module


def is_pretrained(model: nn.Module) -> bool:
    """Whether ``model`` (inside DDP / ``torch.compile`` wrappers) is a ``transformers`` model."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(inner_module(model), PreTrainedModel)


def save_pretrained_dir(model: nn.Module, path: str) -> None:
    """``model.save_pretrained(path)`` through a temp directory and a rename (module docstring)."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bar in a worker's log
    try:
        inner_module(model).save_pretrained(tmp)
        from hpar.strategies.state.checkpoint import default_mode

        os.chmod(
            tmp, default_mode(directory=True)
        )  # as os.makedirs would make it (mkdtemp's is 0700): like the rest of the run
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
