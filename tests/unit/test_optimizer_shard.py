"""The CUDA trainer's optimizer checkpoint (`services/trainer/megatron/optim.py`): a torch
optimizer's state and the parameters it updates, saved and loaded back exactly. Megatron's
distributed optimizer wraps such torch optimizers (over its fp32 main-parameter shards), so the
same two functions carry its checkpoint; here they run on a plain AdamW on the CPU."""

from __future__ import annotations

import pytest
import torch

from services.trainer.megatron.optim import load_optimizer_shard, optimizer_shard


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [
        {"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
    ]
    return model, torch.optim.AdamW(groups, lr=0.01)


def _step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def test_a_shard_round_trips_the_update():
    x = torch.arange(8.0).reshape(2, 4) / 8
    model, opt = _model_and_opt(0)
    _step(model, opt, x)
    shard = optimizer_shard(opt)
    _step(model, opt, x)
    after = [p.detach().clone() for p in model.parameters()]

    fresh_model, fresh_opt = _model_and_opt(1)  # other initial weights, no optimizer state
    load_optimizer_shard(fresh_opt, shard)
    _step(fresh_model, fresh_opt, x)
    assert all(torch.equal(a, b) for a, b in zip(after, fresh_model.parameters(), strict=True))
    assert fresh_opt.state_dict()["state"][0]["step"] == 2


def test_a_shard_of_another_shape_is_refused():
    model, opt = _model_and_opt(0)
    _step(model, opt, torch.ones(1, 4))
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(5))], lr=0.01)
    with pytest.raises(ValueError, match="parameter shapes differ"):
        load_optimizer_shard(other, optimizer_shard(opt))
