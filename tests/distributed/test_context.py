"""DistributedContext and local groups in real multi-process runs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nn_handler import DistributedConfig, DistributedContext, TorchCommunicator
from nn_handler.distributed import (
    create_local_process_group,
    destroy_local_process_group,
    get_dist_info,
    get_local_process_group,
    get_local_rank,
    get_local_size,
)
from nn_handler.distributed.faults.watchdog import WATCHDOGS
from nn_handler.errors import ConfigError, DistributedError, RankFailedError
from tests.harness import free_port, run_group, slurm_env

pytestmark = pytest.mark.distributed


def _context_from_launcher_env(rank: int, world_size: int) -> dict[str, Any]:
    config = DistributedConfig(timeout=timedelta(seconds=30))
    with DistributedContext(config) as ctx:
        seen: dict[str, Any] = {"info": ctx.info, "device": str(ctx.device)}
        seen["gathered"] = [t.tolist() for t in ctx.communicator.all_gather(torch.arange(rank + 1))]
        ctx.create_local_process_group()  # size from LOCAL_WORLD_SIZE
        seen["local"] = (get_local_rank(), get_local_size(), get_local_process_group() is not None)
        with pytest.raises(ConfigError, match=r"world size 2 is not a multiple of .*=3"):
            create_local_process_group(3)
        with pytest.raises(RankFailedError, match="disagrees with LOCAL_WORLD_SIZE=2") as info:
            create_local_process_group(1)
        assert info.value.failed_ranks == [0, 1]
        seen["watchdog"] = (
            WATCHDOGS.watchdog() is not None,
            ctx.config.stall_timeout,  # half of the 30 s timeout given alone
            signal.getsignal(signal.SIGUSR2) != signal.SIG_DFL,  # raises on the main thread
        )
        adopted = DistributedContext(config).setup()  # a second context adopts the group
        adopted.teardown()  # ... and leaves the group and the watchdog to the first
        seen["alive_after_adopter_teardown"] = dist.is_initialized()
        seen["watched_after_adopter_teardown"] = WATCHDOGS.watchdog() is not None
        seen["sum"] = ctx.communicator.all_reduce(rank + 1)
    seen["alive_after_exit"] = dist.is_initialized()
    seen["watchdog_after_exit"] = (
        WATCHDOGS.watchdog() is not None,
        signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
        any(t.name == "nn_handler-watchdog" for t in threading.enumerate()),
    )
    ctx.teardown()
    return seen


def test_context_from_launcher_variables_sets_up_uses_and_tears_down() -> None:
    results = run_group(_context_from_launcher_env, 2, init="env")
    for rank, seen in enumerate(results):
        info = seen["info"]
        assert (info.rank, info.world_size, info.local_rank, info.launcher) == (
            rank,
            2,
            rank,
            "env",
        )
        assert info.master_addr == "127.0.0.1" and seen["device"] == "cpu"
        assert seen["gathered"] == [[0], [0, 1]]
        assert seen["local"] == (rank, 2, True)
        assert seen["alive_after_adopter_teardown"] and seen["sum"] == 3
        assert not seen["alive_after_exit"]
        assert seen["watchdog"] == (True, timedelta(seconds=15), True)
        assert seen["watched_after_adopter_teardown"]
        # Teardown stops the thread and gives SIGUSR2 back.
        assert seen["watchdog_after_exit"] == (False, True, False)


def _local_groups_of_four(rank: int, world_size: int) -> dict[str, Any]:
    group = create_local_process_group(2)  # two "machines" of two processes
    assert create_local_process_group(2) is group, "a second call returns the same group"
    local = TorchCommunicator(group)
    info = get_dist_info()
    seen = {
        "local": (local.rank, local.world_size, get_local_rank(), get_local_size()),
        "node": info.node_rank,
        "sum": local.all_reduce(rank),
        "from_local_0": local.broadcast(rank, src=0),
        "gathered_on_local_1": local.gather_object(rank, dst=1),
    }
    with pytest.raises(ConfigError, match="already exists"):
        create_local_process_group(4)
    with pytest.raises(AssertionError, match="already exists"):  # detectron2's assert
        create_local_process_group(4)
    destroy_local_process_group()
    with pytest.raises(DistributedError, match="call create_local_process_group"):
        get_local_process_group()
    with pytest.raises(AssertionError, match="call create_local_process_group"):  # detectron2
        get_local_process_group()
    with pytest.raises(ConfigError, match="world size 4 is not a multiple"):
        create_local_process_group(3)
    with pytest.raises(AssertionError, match="world size 4 is not a multiple"):  # detectron2
        create_local_process_group(3)
    return seen


def test_local_groups_split_four_ranks_into_two_machines() -> None:
    results = run_group(_local_groups_of_four, 4)
    assert [s["local"] for s in results] == [(0, 2, 0, 2), (1, 2, 1, 2)] * 2
    assert [s["node"] for s in results] == [0, 0, 1, 1]
    assert [s["sum"] for s in results] == [1, 1, 5, 5]
    assert [s["from_local_0"] for s in results] == [0, 0, 2, 2]
    assert [s["gathered_on_local_1"] for s in results] == [[], [0, 1], [], [2, 3]]


def _slurm_task(rank: int, world_size: int) -> tuple[Any, float]:
    with DistributedContext(DistributedConfig(timeout=timedelta(seconds=30))) as ctx:
        return ctx.info, ctx.communicator.all_reduce(float(rank), "mean")


def test_a_slurm_launch_finds_its_master_in_the_nodelist() -> None:
    port = free_port(12000, 32000)  # SLURM ports derive from the job id into this range
    results = run_group(_slurm_task, 2, init="none", env=slurm_env(port))
    for rank, (info, mean) in enumerate(results):
        assert (info.launcher, info.rank, info.master_addr) == ("slurm", rank, "127.0.0.1")
        assert info.master_port == port and mean == 0.5


def _cluster_env(kind: str, port: int) -> Callable[[int], dict[str, str]]:
    """Per-rank variables of a two-node Kubeflow TrainJob or SkyPilot task run without
    torchrun (one process per node), whose head is 127.0.0.1."""

    def for_rank(rank: int) -> dict[str, str]:
        if kind == "kubeflow":
            return {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            }
        return {
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "MASTER_PORT": str(port),
        }

    return for_rank


@pytest.mark.parametrize("kind", ["kubeflow", "skypilot"])
def test_a_cluster_launch_without_torchrun_forms_its_group(kind: str) -> None:
    results = run_group(_slurm_task, 2, init="none", env=_cluster_env(kind, free_port()))
    for rank, (info, mean) in enumerate(results):
        assert (info.launcher, info.rank, info.node_rank, info.local_rank) == (kind, rank, rank, 0)
        assert info.master_addr == "127.0.0.1" and mean == 0.5


def _misplaced_rank(rank: int, world_size: int) -> tuple[list[int], str]:
    try:
        create_local_process_group(2)
    except RankFailedError as error:
        return error.failed_ranks, str(error)
    raise AssertionError("no error")


def test_a_rank_misplaced_on_its_machine_fails_every_rank_instead_of_hanging() -> None:
    def both_say_local_rank_zero(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}

    for failed, text in run_group(_misplaced_rank, 2, env=both_say_local_rank_zero, timeout=60):
        assert failed == [1], "only rank 1 is misplaced, yet rank 0 hears of it too"
        assert "rank 1 would be local rank 1" in text and "LOCAL_RANK=0" in text
