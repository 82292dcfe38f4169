"""The harness itself: results come back by rank; failures and hangs fail fast with tracebacks."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import GroupRunError, run_group
from tests.timeouts import scaled


def _sum_ranks(rank: int, world_size: int) -> tuple[int, float, str, str | None, bool]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    start_method = multiprocessing.get_start_method(allow_none=True)
    # What the forkserver preloaded (torch._dynamo, which an optimizer's first step imports)
    # is imported already, and frozen out of the garbage collector's reach.
    preloaded = "torch._dynamo" in sys.modules and gc.get_freeze_count() > 100_000
    return rank, float(t.item()), os.environ["OMP_NUM_THREADS"], start_method, preloaded


def test_results_come_back_by_rank_from_a_real_gloo_group() -> None:
    # A rank's own processes (DataLoader workers) start as in a fresh interpreter's (a torchrun
    # rank's), not through a forkserver of their own (the default start method, unset).
    expected = [(rank, 1.0, "1", None, True) for rank in (0, 1)]
    assert run_group(_sum_ranks, 2) == expected


def _rank1_raises_while_rank0_waits(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # would wait for the process group timeout


def test_a_failing_rank_fails_the_run_with_its_traceback_and_the_waiting_ranks_stacks() -> None:
    start = time.monotonic()
    with pytest.raises(GroupRunError) as info:
        run_group(_rank1_raises_while_rank0_waits, 2, timeout=60)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "ValueError: boom on rank 1" in text
    assert "rank 0: exit code" in text and "_rank1_raises_while_rank0_waits" in text


def _hang(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_a_hang_is_killed_at_the_deadline_with_each_ranks_stacks() -> None:
    with pytest.raises(GroupRunError) as info:
        run_group(_hang, 2, timeout=6)  # ranks fork in milliseconds: the stacks are in _hang
    text = str(info.value)
    assert f"deadline of {scaled(6):.0f}s passed" in text  # scaled for the machine's load
    assert text.count("in _hang") == 2  # both ranks' stacks point at the sleeping line
