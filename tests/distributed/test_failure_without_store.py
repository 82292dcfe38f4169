"""fail_together on a group without a usable store still aborts the group, so a peer blocked
in a collective stops at once instead of waiting for the process-group timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nn_handler.distributed.faults import failure
from tests.harness import run_group

pytestmark = pytest.mark.distributed


def _fail_without_store(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 1:
        failure.default_store = lambda: None  # type: ignore[assignment]  # as on some MPI setups
        time.sleep(0.5)  # rank 0 is waiting in its all_reduce by now
        original = ValueError("rank 1 broke")
        returned = failure.fail_together(original, rank, world_size, "a step", lambda: None)
        return {"same": returned is original, "group_left": not dist.is_initialized()}
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as error:  # gloo: the peer closed the connection
        return {"raised": type(error).__name__, "seconds": time.monotonic() - started}
    return {"raised": None}


def test_a_failure_without_a_store_still_aborts_the_group() -> None:
    # The harness's group timeout is the run's timeout (60 s): a rank 0 still waiting for
    # rank 1 would make the run time out and fail with both ranks' stacks.
    peer, failed = run_group(_fail_without_store, 2, timeout=60)
    assert failed == {"same": True, "group_left": True}
    assert peer["raised"] is not None, peer
