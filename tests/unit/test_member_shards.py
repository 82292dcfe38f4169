"""A member's state sent rank by rank (training/fault_tolerance/shards.py), in one process:
the plain tensors and values of a state without DTensors, and the payloads refused before
anything changes. The sharded case runs in tests/distributed/test_member_shards.py."""

from __future__ import annotations

import pytest
import torch

from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.fault_tolerance.shards import LAYOUT, STATE, local_state, take_local_state


def test_plain_tensors_are_filled_in_place_and_other_values_taken() -> None:
    sent = {"w": torch.arange(4.0), "groups": [{"lr": 0.5, "step": torch.tensor(3)}], "t": (1, 2)}
    mine = {"w": torch.zeros(4), "groups": [{"lr": 0.1, "step": torch.tensor(0)}], "t": (0, 0)}
    weight = mine["w"]
    filled = take_local_state(mine, local_state(sent), "the state of member 0")
    assert filled["w"] is weight and torch.equal(weight, torch.arange(4.0))
    assert filled["groups"][0]["lr"] == 0.5 and int(filled["groups"][0]["step"]) == 3
    assert filled["t"] == (1, 2) and local_state(sent)[LAYOUT] == {}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({STATE: {"w": torch.ones(4)}}, "it has no shard layout"),
        ({STATE: {"v": torch.ones(4)}, LAYOUT: {}}, "the state differs in its keys"),
        ({STATE: {"w": torch.ones(5)}, LAYOUT: {}}, r"w is float32 of shape \(5,\) there"),
        ({STATE: {"w": [1.0, 2.0]}, LAYOUT: {}}, "w is not a plain tensor"),
    ],
)
def test_a_payload_that_does_not_fit_is_refused_and_nothing_changes(
    payload: dict[str, object], message: str
) -> None:
    mine = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=message):
        take_local_state(mine, payload, "the state of member 0")
    assert torch.equal(mine["w"], torch.zeros(4))


def test_a_list_of_another_length_is_refused() -> None:
    mine = {"groups": [torch.zeros(2), torch.zeros(2)]}
    sent = local_state({"groups": [torch.ones(2)]})
    with pytest.raises(CheckpointError, match="groups differs in length; refused"):
        take_local_state(mine, sent, "the state of member 0")
    assert all(torch.equal(t, torch.zeros(2)) for t in mine["groups"])


def test_a_tensor_sharded_only_on_the_sender_is_a_config_error_naming_it() -> None:
    """The sender's layout names a sharded tensor this member holds whole: another model or
    fsdp settings; the fix is said."""
    sent = {STATE: {"w": torch.ones(4)}, LAYOUT: {".w": [[8], ["Shard(dim=0)"], [2], [0]]}}
    mine = {"w": torch.zeros(4)}
    with pytest.raises(ConfigError, match="w is sharded only on the sending member; every"):
        take_local_state(mine, sent, "the state of member 0")
    assert torch.equal(mine["w"], torch.zeros(4))
