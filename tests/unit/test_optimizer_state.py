"""Optimizer states between torch's index-keyed layout and FSDP2's name-keyed one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nn_handler import CheckpointError
from nn_handler.checkpoint.optimizer_state import is_named, to_indexed, to_named


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}]
    )
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_names_round_trip_and_load_into_a_fresh_optimizer() -> None:
    model, optimizer = _trained()
    indexed = optimizer.state_dict()
    named = to_named(indexed, model, optimizer)
    assert not is_named(indexed) and is_named(named)
    assert named["param_groups"][1]["params"] == ["2.weight", "2.bias"]
    assert set(named["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert _same(to_indexed(named, model, optimizer), indexed)
    fresh_model, fresh = _trained()
    fresh.load_state_dict(to_indexed(named, fresh_model, fresh))
    assert _same(fresh.state_dict(), indexed)


def test_states_that_do_not_fit_name_the_difference() -> None:
    model, optimizer = _trained()
    named = to_named(optimizer.state_dict(), model, optimizer)
    other = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
    wider = torch.optim.Adam(
        [{"params": other[0].parameters()}, {"params": other[2:].parameters()}]
    )
    with pytest.raises(CheckpointError, match=r"groups of \[2, 2\] parameters .* \[2, 4\]"):
        to_indexed(named, other, wider)
    renamed = {**named, "param_groups": [dict(g) for g in named["param_groups"]]}
    renamed["param_groups"][0]["params"] = ["a.weight", "a.bias"]
    with pytest.raises(CheckpointError, match="names other parameters than this model's"):
        to_indexed(renamed, model, optimizer)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(CheckpointError, match="is not a parameter of Sequential"):
        to_named(stranger.state_dict(), model, stranger)
