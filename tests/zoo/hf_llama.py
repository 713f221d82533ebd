"""A Hugging Face Llama built from a small config (random init, no download): RMSNorm, rotary
position embeddings, grouped-query attention, an untied ``lm_head``; fed a dict batch with an
attention mask, as ``model(**batch)``."""

import torch, torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.05, "log_every": 2}
VOCAB, SEQ = 64, 12


def model():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
    )


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(650 + rank)
    for _ in range(1000):
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1) * (1 + start % 3)) % VOCAB
        yield {"input_ids": ids[:, :-1], "attention_mask": torch.ones(batch_size, SEQ, dtype=torch.long)}, ids[:, 1:]


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=HPAR["lr"], momentum=0.9)
