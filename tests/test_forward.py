"""How hpar calls the user's model (strategies/job/forward.py): a dict batch whose keys are the
forward's parameter names goes in as keyword arguments (the Hugging Face convention), any
other batch as one argument; wrappers (DDP, torch.compile) are looked through."""

import torch
from torch import nn

from hpar.strategies.job.forward import call_model, inner_module, takes_keywords


class Named(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids * (1 if attention_mask is None else attention_mask)


class Whole(nn.Module):
    def forward(self, batch):
        return batch["ids"] + 1


class Kwargs(nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return input_ids + len(kwargs)


def test_dict_of_forward_names_goes_in_as_keywords():
    ids, mask = torch.ones(2, 3), torch.zeros(2, 3)
    assert takes_keywords(Named(), {"input_ids": ids, "attention_mask": mask})
    assert torch.equal(call_model(Named(), {"input_ids": ids, "attention_mask": mask}), ids * mask)
    assert takes_keywords(Named(), {"input_ids": ids})


def test_other_batches_go_in_whole():
    assert not takes_keywords(Whole(), {"ids": torch.ones(2)})
    assert torch.equal(call_model(Whole(), {"ids": torch.ones(2)}), torch.full((2,), 2.0))
    assert not takes_keywords(Named(), torch.ones(2))
    assert not takes_keywords(Named(), {"input_ids": torch.ones(2), "labels_extra": torch.ones(2)})
    assert not takes_keywords(Named(), {})


def test_var_keyword_forward_takes_a_dict_with_one_known_name():
    batch = {"input_ids": torch.ones(2), "token_type_ids": torch.ones(2)}
    assert takes_keywords(Kwargs(), batch)
    assert torch.equal(call_model(Kwargs(), batch), torch.full((2,), 2.0))
    assert not takes_keywords(Kwargs(), {"other": torch.ones(2)})


def test_wrappers_are_looked_through():
    compiled = torch.compile(Named(), backend="eager")
    assert inner_module(compiled) is compiled._orig_mod
    assert takes_keywords(compiled, {"input_ids": torch.ones(2)})
