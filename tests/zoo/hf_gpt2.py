"""A Hugging Face GPT-2 built from a small config (random init, no download), as people bring
it: its output projection ``lm_head`` is tied to the token embedding ``transformer.wte`` (one
parameter, dense), its position table ``wpe`` is an untied nn.Embedding of which a sequence
touches half the rows (row-sparse: ``allreduce-sparse`` gives it sparse gradients, which AdamW
cannot step), and it trains with AdamW. Dropout is off so that runs compare exactly."""

import torch, torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.01, "log_every": 2}
VOCAB, SEQ = 64, 12


def model():
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=2 * SEQ,
            n_embd=32,
            n_layer=4,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(600 + rank)
    for _ in range(1000):
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1) * (1 + start % 3)) % VOCAB  # learnable: a stride per sequence
        yield ids[:, :-1], ids[:, 1:]


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=HPAR["lr"])
