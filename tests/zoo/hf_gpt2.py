"""A GPT-2 from Hugging Face ``transformers`` as people bring it: built from a tiny config
(random init, no download), trained with AdamW. Its position table ``wpe`` is an untied
nn.Embedding (row-sparse: ``allreduce-sparse`` gives it sparse gradients, which AdamW cannot
step); the token table ``wte`` is tied to ``lm_head`` (dense). Needs ``transformers``."""
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

HPAR = {"steps": 10, "batch_size": 4, "lr": 1e-3, "log_every": 5}
VOCAB, T = 100, 16


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                              bos_token_id=0, eos_token_id=0))

    def forward(self, ids):                          # ids (B, T) -> logits (B, T, VOCAB)
        return self.gpt(input_ids=ids).logits


def model():
    return LM()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(1000):
        ids = torch.randint(0, VOCAB, (batch_size, T + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=HPAR["lr"])
