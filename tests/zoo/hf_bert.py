"""A Hugging Face BERT masked language model built from a small config (random init, no
download), fed the way HF users feed it: a dict batch with an attention mask over padded
sequences of different lengths, which reaches the model as ``model(**batch)``. Two tokens of
every sequence are masked, so that every micro-batch's mean loss weighs its tokens as the
whole batch's does (pipelines and data parallelism average per-micro-batch means)."""

import torch, torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.05, "log_every": 2}
VOCAB, SEQ, MASK, PAD = 48, 12, 1, 0


def model():
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD,
    )
    return BertForMaskedLM(cfg)


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(700 + rank)
    for _ in range(1000):
        lengths = torch.randint(SEQ // 2, SEQ + 1, (batch_size,), generator=g)
        start = torch.randint(2, VOCAB - SEQ, (batch_size, 1), generator=g)
        ids = start + torch.arange(SEQ)  # counting sequences: learnable
        pad = torch.arange(SEQ) >= lengths[:, None]
        ids[pad] = PAD
        score = torch.rand(batch_size, SEQ, generator=g).masked_fill(pad, -1.0)
        masked = torch.zeros(batch_size, SEQ, dtype=torch.bool).scatter(1, score.topk(2, dim=1).indices, True)
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        inputs = ids.masked_fill(masked, MASK)
        yield {"input_ids": inputs, "attention_mask": (~pad).long()}, labels


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)
