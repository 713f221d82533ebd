"""A Hugging Face T5 (encoder-decoder) built from a tiny config (random init, no download), fed
as its tutorials feed it: a dict batch {input_ids, attention_mask, decoder_input_ids} that
reaches the model as ``model(**batch)``; the loss is taken outside the model from the logits
(shifted targets), with dropout off so that a pipeline can equal one process."""

import torch, torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

HPAR = {"steps": 6, "batch_size": 8, "lr": 0.05, "log_every": 2}
VOCAB, SRC, TGT, PAD = 40, 10, 8, 0


def model():
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=PAD,
        pad_token_id=PAD,
    )
    return T5ForConditionalGeneration(cfg)


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(900 + rank)
    for _ in range(1000):
        start = torch.randint(2, VOCAB - SRC - 1, (batch_size, 1), generator=g)
        src = start + torch.arange(SRC)  # a counting sequence ...
        tgt = start + 1 + torch.arange(TGT)  # ... and the same, shifted by one
        dec = torch.cat([torch.full((batch_size, 1), PAD), tgt[:, :-1]], 1)
        yield {"input_ids": src, "attention_mask": torch.ones_like(src), "decoder_input_ids": dec}, tgt


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)
