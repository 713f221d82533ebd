"""A small GPT-2 from Hugging Face ``transformers`` trained on WikiText-2, unmodified.

The model is ``GPT2LMHeadModel`` built from a config (random init, no download; its output
projection is tied to the token embedding, as in every GPT-2), over the word vocabulary
``examples/lm.py`` builds from the shipped text (no tokenizer can be downloaded here), trained
with AdamW, a warm-up and a cosine schedule. ``evaluate`` reports the validation loss and
perplexity. At the end of a run the trained weights are in ``RUN_DIR/hf``, in HF's own
format: ``GPT2LMHeadModel.from_pretrained(RUN_DIR + "/hf")`` loads them.

Every strategy runs it as it is: ``allreduce`` (DDP), ``pipeline`` (torch's tracer cuts it
between its blocks; the tied embedding on the first and last stage stays one parameter), and
``hybrid``/``allreduce-sparse`` where the planner finds a table worth serving.

Data: WikiText-2 *test* for training, *valid* for evaluation (examples/data/wikitext-2,
CC BY-SA 3.0). Needs the ``hf`` extra: ``pip install -e '.[hf]'``.
Run: ``hpar run examples/hf_gpt2.py --gpus 2``.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lm import corpus, warmup_cosine, windows  # noqa: E402  (examples/lm.py's vocabulary, streams and schedule)

CONTEXT = 64
HPAR = {"batch_size": 16, "steps": 200, "lr": 3e-3, "log_every": 10, "eval_every": 100, "clip_grad_norm": 1.0}
EVAL_TOKENS = 8_192


def model():
    vocab = len(corpus()[0])
    # no dropout: a short run does not need it, and without it every strategy (a pipeline's
    # stages draw their own random numbers) trains exactly the weights one process trains
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab,
            n_positions=CONTEXT,
            n_embd=128,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def data(rank, world_size, batch_size):
    """This rank's contiguous shard of the training stream, as (batch, CONTEXT) windows: the
    inputs, and the same tokens one position on as targets."""
    yield from windows(rank, world_size, batch_size, CONTEXT)


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=HPAR["lr"], weight_decay=0.01)


def scheduler(opt):
    """Linear warm-up over 20 steps, then cosine decay to 10% at the last step (lm.py's)."""
    return warmup_cosine(opt, HPAR["steps"])


def evaluate(model):
    """Loss and perplexity on the first EVAL_TOKENS tokens of the validation split."""
    dev = next(model.parameters()).device
    ids = corpus()[2][: EVAL_TOKENS + 1].to(dev)
    rows = (len(ids) - 1) // CONTEXT
    x, y = ids[: rows * CONTEXT].view(rows, CONTEXT), ids[1 : rows * CONTEXT + 1].view(rows, CONTEXT)
    total = sum(
        F.cross_entropy(model(x[i : i + 32]).logits.flatten(0, 1), y[i : i + 32].flatten(), reduction="sum").item()
        for i in range(0, rows, 32)
    )
    val = total / y.numel()
    return {"val_loss": val, "perplexity": math.exp(val)}
