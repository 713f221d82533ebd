"""Fine-tuning as tutorials write it: a Hugging Face Llama built from a small config (random
init, no download) whose token embedding and first decoder block are frozen
(``requires_grad=False``), with the optimizer given only the trainable parameters."""

import torch, torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

HPAR = {"steps": 4, "batch_size": 8, "lr": 0.05, "log_every": 1}
VOCAB, SEQ = 64, 8


def model():
    m = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
    )
    m.model.embed_tokens.requires_grad_(False)
    m.model.layers[0].requires_grad_(False)
    return m


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(670 + rank)
    for _ in range(1000):
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1) * (1 + start % 3)) % VOCAB
        yield {"input_ids": ids[:, :-1], "attention_mask": torch.ones(batch_size, SEQ, dtype=torch.long)}, ids[:, 1:]


def loss(output, targets):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=HPAR["lr"], momentum=0.9)
