"""TorchCommunicator over real gloo groups: the contract, and what goes wrong on one rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from nn_handler.distributed.communicator import TorchCommunicator
from nn_handler.errors import CollectiveMismatchError, DistributedError, RankFailedError
from tests import communicator_contract as contract
from tests.harness import run_group
from tests.timeouts import scaled_now

pytestmark = pytest.mark.distributed


def _contract(rank: int, world_size: int) -> list[str]:
    comm = TorchCommunicator()
    assert (comm.rank, comm.world_size, comm.backend) == (rank, world_size, "gloo")
    return contract.run_all(comm)


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_communicator_meets_the_contract(world_size: int) -> None:
    names = [check.__name__ for check in contract.CHECKS]
    assert run_group(_contract, world_size) == [names] * world_size


def _expect_everywhere(what: str, call: Any, error_type: type[BaseException]) -> dict[str, Any]:
    """Run ``call``; it must raise ``error_type`` fast; report what this rank saw."""
    start = time.monotonic()
    with pytest.raises(error_type) as info:
        call()
    return {"what": what, "seconds": time.monotonic() - start, "error": info.value}


def _failures(rank: int, world_size: int) -> list[dict[str, Any]]:
    comm = TorchCommunicator()
    seen = []
    # An unpicklable object on rank 1 only: every rank raises, naming rank 1.
    seen.append(
        _expect_everywhere(
            "all_gather_object",
            lambda: comm.all_gather_object(contract.unpicklable() if rank == 1 else rank),
            RankFailedError,
        )
    )
    seen.append(
        _expect_everywhere(
            "gather_object",
            lambda: comm.gather_object(contract.unpicklable() if rank == 1 else rank, dst=0),
            RankFailedError,
        )
    )
    seen.append(
        _expect_everywhere(
            "broadcast_object",
            lambda: comm.broadcast_object(contract.unpicklable(), src=1),
            RankFailedError,
        )
    )

    # An exception on rank 1 reaches every rank with its traceback.
    def step() -> None:
        error: BaseException | None = None
        try:
            if rank == 1:
                raise ZeroDivisionError("bad batch 17")
        except ZeroDivisionError as caught:
            error = caught
        comm.raise_if_any_failed(error, "training step")

    seen.append(_expect_everywhere("raise_if_any_failed", step, RankFailedError))
    # Shapes that cannot be gathered: every rank gets the list of shapes, no debug mode needed.
    seen.append(
        _expect_everywhere(
            "all_gather trailing dims",
            lambda: comm.all_gather(torch.zeros(2, 3 + rank)),
            CollectiveMismatchError,
        )
    )
    seen.append(
        _expect_everywhere(
            "all_gather dtype",
            lambda: comm.all_gather(torch.zeros(2, dtype=torch.int64 if rank else torch.float32)),
            CollectiveMismatchError,
        )
    )
    # After all of that the group is still aligned.
    assert comm.all_reduce(torch.tensor([1.0])).item() == world_size
    return [{**s, "error": (type(s["error"]).__name__, str(s["error"]), s["error"])} for s in seen]


def test_one_rank_failing_raises_on_every_rank_and_the_group_stays_usable() -> None:
    per_rank = run_group(_failures, 2)
    for rank, seen in enumerate(per_rank):
        for item in seen:
            took = item["seconds"]  # 10 s at low load: raised at once, not at a timeout
            assert took < scaled_now(10), f"{item['what']} took {took:.1f}s on {rank}"
        by_what = {item["what"]: item["error"] for item in seen}
        for what in ("all_gather_object", "gather_object", "broadcast_object"):
            name, text, error = by_what[what]
            assert name == "RankFailedError" and error.failed_ranks == [1]
            assert "rank(s) [1]" in text and "lock" in text, text
        _, text, error = by_what["raise_if_any_failed"]
        assert error.failed_ranks == [1] and "training step failed" in text
        assert "--- rank 1 --- ZeroDivisionError: bad batch 17 at " in text
        assert "Traceback" not in text and "Traceback" in error.rank_messages[1]
        _, text, _ = by_what["all_gather trailing dims"]
        assert "rank 0: float32[2, 3]" in text and "rank 1: float32[2, 4]" in text
        _, text, _ = by_what["all_gather dtype"]
        assert "rank 0: float32[2]" in text and "rank 1: int64[2]" in text


def _failing_rank_keeps_the_cause(rank: int, world_size: int) -> tuple[str | None, bool]:
    comm = TorchCommunicator()
    original = ValueError("only here") if rank == 0 else None
    try:
        comm.raise_if_any_failed(original, "load")
    except RankFailedError as error:
        cause = error.__cause__
        return (type(cause).__name__ if cause else None), cause is not None and cause is original
    raise AssertionError("no error raised")


def test_the_failing_rank_chains_its_original_exception() -> None:
    assert run_group(_failing_rank_keeps_the_cause, 2) == [("ValueError", True), (None, False)]


def _debug_mismatches(rank: int, world_size: int) -> list[str]:
    comm = TorchCommunicator(debug=True)
    messages = []
    calls = [
        lambda: comm.all_reduce(torch.zeros(3 + rank)),  # shapes differ
        lambda: comm.all_reduce(torch.zeros(3)) if rank == 0 else comm.broadcast(torch.zeros(3)),
        lambda: comm.barrier() if rank == 0 else comm.all_gather(torch.zeros(1)),
        lambda: comm.reduce_dict({"acc": 1.0} if rank == 0 else {"loss": 1.0}),
        lambda: comm.all_reduce("oops" if rank == 1 else 1.0),
    ]
    for call in calls:
        with pytest.raises(CollectiveMismatchError) as info:
            call()
        messages.append(str(info.value))
    assert comm.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    return messages


def test_debug_mode_turns_mismatched_collectives_into_errors_on_every_rank() -> None:
    per_rank = run_group(_debug_mismatches, 2)
    assert per_rank[0] == per_rank[1], "both ranks report the same thing"
    shapes, ops, barrier, keys, invalid = per_rank[0]
    assert "rank 0: all_reduce(op=sum) float32[3]" in shapes
    assert "rank 1: all_reduce(op=sum) float32[4]" in shapes
    assert "rank 1: broadcast(src=0)" in ops
    assert "rank 0: barrier()" in barrier and "rank 1: all_gather(tensor)" in barrier
    assert "'acc'" in keys and "'loss'" in keys
    assert "invalid input" in invalid and "str" in invalid


def _debug_from_env(rank: int, world_size: int) -> bool:
    comm = TorchCommunicator()
    comm.barrier()  # no rank leaves (and closes its side) before every rank formed the group
    return comm.debug


def test_debug_mode_is_switched_on_by_the_environment_variable_on_every_rank() -> None:
    env = {"NN_HANDLER_DEBUG_COLLECTIVES": "1"}
    assert run_group(_debug_from_env, 2, env=env) == [True, True]


def _late_rank(rank: int, world_size: int) -> str | None:
    comm = TorchCommunicator()
    if rank == 0:
        try:
            comm.barrier(timeout=1.0)
        except DistributedError as error:
            return str(error)
        return None
    time.sleep(3)  # never reaches the barrier in time
    return None


def test_a_barrier_with_timeout_names_the_rank_that_did_not_arrive() -> None:
    message, _ = run_group(_late_rank, 2)
    assert message is not None and "Ranks 1 failed to pass monitoredBarrier" in message


def test_torch_communicator_without_a_group_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="NullCommunicator"):
        TorchCommunicator()


def _large_payloads(rank: int, world_size: int) -> dict[str, Any]:
    comm = TorchCommunicator()
    # Above the 16 MiB threshold on rank 0 only: the payloads move one rank at a time.
    big = bytes([7]) * (17 * 2**20) if rank == 0 else b"small"
    gathered = comm.all_gather_object({"rank": rank, "data": big, "t": torch.full((3,), rank)})
    sizes = [len(g["data"]) for g in gathered]
    ok = all(g["rank"] == i and g["t"].tolist() == [i] * 3 for i, g in enumerate(gathered))
    # A pickling failure next to a large payload still names the failing rank everywhere.
    try:
        comm.all_gather_object(big if rank == 0 else contract.unpicklable())
    except RankFailedError as error:
        failed = error.failed_ranks
    return {"sizes": sizes, "ok": ok, "failed": failed}


def test_large_object_payloads_move_rank_by_rank_and_still_agree_on_failures() -> None:
    for result in run_group(_large_payloads, 2):
        assert result == {"sizes": [17 * 2**20, 5], "ok": True, "failed": [1]}
