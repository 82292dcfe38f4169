"""on_rank and main_process_first in real gloo groups: errors reach every rank, fast."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from nn_handler.distributed import communicator
from nn_handler.errors import ConfigError, RankFailedError
from nn_handler.utils.ddp_decorators import main_process_first, on_rank
from tests.harness import run_group
from tests.timeouts import scaled_now

pytestmark = pytest.mark.distributed


def _caught(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except RankFailedError as error:
        cause = error.__cause__
        return {
            "seconds": time.monotonic() - start,
            "failed": error.failed_ranks,
            "text": str(error),
            "whole": error.rank_messages,
            "cause": type(cause).__name__ if cause is not None else None,
        }
    raise AssertionError("no RankFailedError")


def _on_rank_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    comm = communicator()
    seen: dict[str, Any] = {}

    @on_rank(0)
    def fails_on_zero() -> None:
        time.sleep(0.5)  # rank 1 is already waiting when this fails
        raise ValueError("checkpoint dir missing")

    @on_rank(1)
    def fails_on_one() -> None:
        raise KeyError("no such key")

    @on_rank([0, 1])
    def fails_on_one_of_two() -> int:
        if rank == 1:
            raise RuntimeError("only rank 1 breaks")
        return rank

    @on_rank([0, 1])
    def fails_on_both() -> None:
        raise ZeroDivisionError(f"rank {rank}")

    for name, fn in [
        ("rank0", fails_on_zero),
        ("rank1", fails_on_one),
        ("one_of_two", fails_on_one_of_two),
        ("both", fails_on_both),
    ]:
        seen[name] = _caught(fn)
        # After each caught error the group is aligned: the next collective is right.
        seen[f"{name}_sum"] = comm.all_reduce(rank + 1)

    @on_rank(0)
    def value() -> str:
        return "from rank 0"

    @on_rank(1, broadcast=True, barrier=True)
    def shared() -> dict[str, int]:
        return {"lr": 3}

    seen["value"] = value()
    seen["shared"] = shared()
    with pytest.raises(ConfigError, match="rank 5 does not exist in a world of 2"):
        on_rank(5)(lambda: None)()
    return seen


def test_on_rank_errors_reach_every_rank_and_the_group_stays_aligned() -> None:
    results = run_group(_on_rank_scenarios, 2, timeout=60)
    for rank, seen in enumerate(results):
        for name in ("rank0", "rank1", "one_of_two", "both"):
            assert seen[f"{name}_sum"] == 3, f"group misaligned after {name}"
            took = seen[name]["seconds"]  # 5 s at low load: no rank waits for a timeout
            assert took < scaled_now(5), f"{name} took {took:.1f}s"
        zero = seen["rank0"]
        assert zero["failed"] == [0]
        assert (
            "@on_rank(0) " in zero["text"] and "fails_on_zero failed on rank(s) [0]" in zero["text"]
        )
        # One line per failed rank (its own error is the cause it prints); the whole
        # traceback stays on the error.
        assert "--- rank 0 --- ValueError: checkpoint dir missing at " in zero["text"]
        assert "in fails_on_zero (the traceback: rank 0's output" in zero["text"]
        assert "Traceback" not in zero["text"] and "Traceback" in zero["whole"][0]
        assert zero["cause"] == ("ValueError" if rank == 0 else None)
        assert seen["rank1"]["failed"] == [1] and "KeyError: 'no such key'" in seen["rank1"]["text"]
        assert seen["rank1"]["cause"] == ("KeyError" if rank == 1 else None)
        assert seen["one_of_two"]["failed"] == [1]
        assert "@on_rank([0, 1])" in seen["one_of_two"]["text"]
        assert seen["both"]["failed"] == [0, 1]
        assert "rank 0" in seen["both"]["text"] and "rank 1" in seen["both"]["text"]
        assert seen["value"] == ("from rank 0" if rank == 0 else None)
        assert seen["shared"] == {"lr": 3}


def _main_first(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    marker = Path(folder, "downloaded")
    seen: dict[str, Any] = {}
    with main_process_first():
        if rank == 0:
            time.sleep(0.5)
            marker.write_text("data")
        seen["saw_data"] = marker.exists()
    ran_body = []

    def main_fails() -> None:
        with main_process_first():
            ran_body.append(rank)
            if rank == 0:
                raise FileNotFoundError("download failed")

    seen["main_fails"] = _caught(main_fails)
    seen["ran_body"] = list(ran_body)

    def other_fails() -> None:
        with main_process_first():
            if rank == 1:
                raise PermissionError("cannot read")

    seen["other_fails"] = _caught(other_fails)
    seen["sum"] = communicator().all_reduce(1)
    return seen


def test_main_process_first_orders_the_body_and_propagates_failures(tmp_path: Path) -> None:
    results = run_group(_main_first, 2, args=(str(tmp_path),), timeout=60)
    for rank, seen in enumerate(results):
        assert seen["saw_data"], f"rank {rank} ran before the main process finished"
        assert seen["main_fails"]["failed"] == [0]
        assert "FileNotFoundError: download failed" in seen["main_fails"]["text"]
        assert seen["ran_body"] == ([0] if rank == 0 else []), "waiting ranks must not run it"
        assert seen["other_fails"]["failed"] == [1], "the main process hears of it too"
        assert seen["sum"] == 2


def _local_main_first(rank: int, world_size: int, folder: str) -> list[str]:
    order = Path(folder, "order")
    with main_process_first(local=True):
        with order.open("a") as handle:
            handle.write(f"{rank}\n")
        time.sleep(0.3)
    communicator().barrier()
    return order.read_text().split()


def test_local_main_process_first_lets_each_machines_local_rank_zero_go_first(
    tmp_path: Path,
) -> None:
    def two_machines(rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
        }

    order = run_group(_local_main_first, 4, args=(str(tmp_path),), env=two_machines)[0]
    assert sorted(order[:2]) == ["0", "2"] and sorted(order[2:]) == ["1", "3"]
