"""The tiny Llama the pruning tests prune, and how they compare it before and after."""

import torch

from labkit.models import tiny_llama


def _model(**kwargs):
    return tiny_llama(vocab_size=128, num_heads=4, num_kv_heads=2, **kwargs)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _blocks(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 128, (n, 2, 17), generator=g)]
