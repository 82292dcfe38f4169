"""Every seed function in real 2-process gloo groups."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nn_handler import distributed as nd
from nn_handler.distributed.local_groups import LOCAL_GROUPS
from nn_handler.errors import ConfigError
from nn_handler.utils import dd_helpers, ddp
from tests.harness import free_port, run_command, run_group, torchrun_command

pytestmark = pytest.mark.distributed


def _printed(call: Any) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        call()
    return buffer.getvalue()


def _every_seed_function(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    # seed 002: initialize_ddp initialises from the launcher's variables, then returns None.
    seen["initialize_ddp"] = ddp.initialize_ddp()
    seen["initialize_ddp_again"] = ddp.initialize_ddp()
    nd.init_dist("gloo")  # already initialised: adopted, no error
    # seed 004
    seen["state"] = (
        nd.is_dist_active(),
        nd.is_using_torchrun(),
        nd.get_global_rank(),
        nd.get_local_rank(),
        nd.get_local_world_size(),
        nd.get_world_size(),
        nd.get_dist_info().launcher,
    )
    seen["into"] = nd.gather_into_tensor(torch.tensor([rank, rank]), (4,)).tolist()
    seen["stacked"] = nd.gather_into_tensor(torch.tensor([rank, rank]), (2, 2)).tolist()
    with pytest.raises(ConfigError, match=r"size=\(5,\) does not hold"):
        nd.gather_into_tensor(torch.tensor([rank]), (5,))
    t = torch.tensor([float(rank + 1)])
    seen["in_place"] = (nd.all_reduce_tensors(t) is t, t.item())
    seen["list"] = nd.all_reduce_tensors([torch.tensor([1.0]), torch.tensor([2.0, 3.0])]).tolist()
    seen["avg"] = nd.all_reduce_tensors(torch.tensor([float(rank)]), op=dist.ReduceOp.AVG).item()
    seen["max"] = nd.all_reduce_tensors(torch.tensor([rank]), op=dist.ReduceOp.MAX).item()
    seen["prints"] = (
        _printed(lambda: nd.global_print("g0")),
        _printed(lambda: nd.global_print("g1", global_rank=1)),
        _printed(lambda: nd.local_print("l0")),
    )
    nd.safe_barrier()
    nd.safe_barrier(timeout=30)
    # seed 000
    seen["000"] = (nd.get_world_size(), nd.get_rank(), nd.is_main_process(), nd.get_local_size())
    nd.synchronize()
    seen["all_gather"] = nd.all_gather(["p"] * rank)
    seen["gather"] = nd.gather({"r": rank}, dst=0)
    seen["reduce_dict"] = nd.reduce_dict(
        {"acc": float(rank), "loss": float("nan") if rank else 4.0}
    )
    seen["reduce_dict_ignoring_nan"] = nd.reduce_dict(
        {"acc": float(rank), "loss": float("nan") if rank else 4.0}, ignore_nan=True
    )
    seeds = nd.all_gather(nd.shared_random_seed())
    seen["seed_shared"] = len(set(seeds)) == 1
    group = nd.create_local_process_group(2)
    seen["local_group"] = group is not None and nd.get_local_process_group() is group
    seen["gpu_line"] = _printed(lambda: nd.print_gpu_memory_usage(0))
    # seed 001
    cpu = torch.device("cpu")
    metrics = {"acc": 0.5 + rank * 0.25, "f1": float("nan") if rank == 0 else 0.8}
    seen["metrics"] = dd_helpers.aggregate_metrics(metrics, world_size, cpu)
    seen["loss"] = dd_helpers.aggregate_loss(float(rank), world_size, cpu)
    seen["broadcast"] = dd_helpers.broadcast_data({"from": rank}, src=1)
    seen["broadcast_if"] = dd_helpers.broadcast_if_ddp(f"cfg-{rank}")
    nd.shutdown_dist()
    seen["after_shutdown"] = (nd.is_dist_active(), LOCAL_GROUPS.get(), nd.get_local_size())
    nd.shutdown_dist()
    return seen


def test_every_seed_function_in_a_two_process_group() -> None:
    results = run_group(_every_seed_function, 2, init="env")
    for rank, seen in enumerate(results):
        assert seen["initialize_ddp"] == (True, rank, rank, 2, torch.device("cpu"))
        assert seen["initialize_ddp_again"] is None
        assert seen["state"] == (True, False, rank, rank, 2, 2, "env")
        assert seen["into"] == [0, 0, 1, 1] and seen["stacked"] == [[0, 0], [1, 1]]
        assert seen["in_place"] == (True, 3.0)
        assert seen["list"] == [2.0, 4.0, 6.0]
        assert (seen["avg"], seen["max"]) == (0.5, 1)
        g0, g1, l0 = seen["prints"]
        assert (g0, g1, l0) == (("g0\n", "", "l0\n") if rank == 0 else ("", "g1\n", ""))
        assert seen["000"] == (2, rank, rank == 0, 2)
        assert seen["all_gather"] == [[], ["p"]]
        assert seen["gather"] == ([{"r": 0}, {"r": 1}] if rank == 0 else [])
        assert seen["reduce_dict"]["acc"] == 0.5
        assert math.isnan(seen["reduce_dict"]["loss"])  # rank 1's NaN reaches it, as detectron2
        assert seen["reduce_dict_ignoring_nan"] == {"acc": 0.5, "loss": 4.0}  # left out
        assert seen["seed_shared"] and seen["local_group"]
        expected_line = (
            "memory: allocated" if torch.cuda.is_available() else "CUDA is not available"
        )
        assert expected_line in seen["gpu_line"]
        assert seen["metrics"]["acc"] == pytest.approx(0.625)
        assert seen["metrics"]["f1"] == pytest.approx(0.8)  # rank 0's NaN left out
        assert seen["loss"] == 0.5
        assert seen["broadcast"] == {"from": 1} and seen["broadcast_if"] == "cfg-0"
        # The local group is gone; the launcher's variables still say 2 per machine.
        assert seen["after_shutdown"] == (False, None, 2)


def _manual_init(rank: int, world_size: int) -> tuple[Any, float]:
    nd.init_dist("gloo", rank=rank, world_size=world_size)
    try:
        return nd.get_dist_info(), nd.reduce_dict({"x": float(rank)})["x"]
    finally:
        nd.shutdown_dist()


def test_manual_init_dist_with_explicit_rank_and_world_size() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for rank, (info, mean) in enumerate(run_group(_manual_init, 2, init="none", env=env)):
        assert (info.launcher, info.rank, info.local_rank, info.world_size) == (
            "manual",
            rank,
            rank,
            2,
        )
        assert math.isclose(mean, 0.5)


SCRIPT = Path(__file__).parent.parent / "scripts" / "torchrun_functional.py"


@pytest.mark.parametrize("entry", ["init_dist", "initialize_ddp"])
def test_functional_api_under_real_torchrun(entry: str, tmp_path: Path) -> None:
    code, output = run_command(torchrun_command(SCRIPT, entry, str(tmp_path)), timeout=120)
    assert code == 0, output
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        assert line == f"rank={rank} local_rank={rank} local_world=2 world=2 torchrun=True ok", line
