"""NullCommunicator: the contract in one process, plus what only one process shows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import ConfigError
from tests import communicator_contract as contract


@pytest.mark.parametrize("check", contract.CHECKS, ids=lambda c: c.__name__)
def test_null_communicator_meets_the_contract(check: Callable[[Communicator], None]) -> None:
    check(NullCommunicator())


def test_debug_mode_is_harmless_in_one_process() -> None:
    comm = NullCommunicator(debug=True)
    assert comm.debug and comm.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


def test_debug_mode_follows_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NN_HANDLER_DEBUG_COLLECTIVES", "1")
    assert NullCommunicator().debug
    assert not NullCommunicator(debug=False).debug


def test_one_process_reraises_the_original_error_unchanged() -> None:
    error = KeyError("missing")
    with pytest.raises(KeyError) as info:
        NullCommunicator().raise_if_any_failed(error, "step")
    assert info.value is error


def test_results_keep_their_device_and_never_alias_inputs() -> None:
    comm = NullCommunicator()
    t = torch.arange(3.0)
    for out in (comm.all_reduce(t), comm.broadcast(t), comm.all_gather(t)[0]):
        out.add_(1)
    assert t.tolist() == [0.0, 1.0, 2.0]


def test_objects_come_back_as_is_in_one_process() -> None:
    comm = NullCommunicator()
    lock = contract.unpicklable()
    assert comm.all_gather_object(lock) == [lock]
    assert comm.broadcast_object(lock) is lock


def test_in_place_reduction_copies_nothing_whatever_the_device() -> None:
    """A group of one reduces in place without a copy, also a tensor on another device than
    the communicator's (the reproducible mode's int64 sum on a GPU without a process group
    went to the host and back every step); its argument checks stay."""
    comm = NullCommunicator("meta")  # a tensor on the CPU would be copied to it and back
    values = torch.tensor([1.5, -2.0])
    for op in ("sum", "mean", "max", "min", "product"):
        assert comm.all_reduce_(values, op) is values and values.tolist() == [1.5, -2.0]
    with pytest.raises(ConfigError, match=r"all_reduce_\(op='mean'\).*int64"):
        comm.all_reduce_(torch.ones(2, dtype=torch.int64), "mean")
