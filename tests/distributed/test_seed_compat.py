"""Seed functions behave like the originals on the edge cases their users hit (seed 000's
dist_utils / detectron2's comm, seed 004's helios.core.distributed), on 2 real gloo ranks.
Deliberate differences are listed in docs/seed_compatibility.md."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import distributed as nd
from tests.harness import run_group

pytestmark = pytest.mark.distributed


def _edges(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    nd.init_dist("GLOO")  # torch accepts any case
    try:
        # safe_clone (default) detaches: gathered tensors carry no autograd history.
        leaf = torch.ones(2, requires_grad=True)
        gathered = nd.all_gather({"t": leaf * (rank + 1)})
        seen["detached"] = [g["t"].requires_grad for g in gathered]
        seen["values"] = [g["t"].tolist() for g in gathered]
        own = torch.ones(1, requires_grad=True)
        seen["not_cloned"] = nd.all_gather(own, safe_clone=False)[rank] is own
        # all_reduce_tensors on an nn.Parameter (a leaf that requires grad), in place.
        weight = nn.Parameter(torch.full((2,), float(rank + 1)))
        result = nd.all_reduce_tensors(weight)
        seen["parameter"] = (result is weight, weight.tolist(), weight.requires_grad)
        # a list of 0-d tensors is stacked; a list of 1-d ones concatenated.
        seen["scalars"] = nd.all_reduce_tensors([torch.tensor(1.0), torch.tensor(2.0)]).tolist()
        seen["vectors"] = nd.all_reduce_tensors([torch.ones(2), torch.zeros(1)]).tolist()
        # async_op is accepted and the call completes before it returns.
        nd.safe_barrier(async_op=True)
        seen["async_reduce"] = nd.all_reduce_tensors(torch.ones(1), async_op=True).tolist()
        into = nd.gather_into_tensor(torch.full((1,), rank), (world_size,), async_op=True)
        seen["async_gather"] = into.tolist()
    finally:
        nd.shutdown_dist()
    return seen


def _per_device_backend(rank: int, world_size: int) -> float:
    # A second init on the same port right after a shutdown could meet the old store: a
    # group of its own.
    nd.init_dist("cpu:gloo,cuda:nccl")  # torch's per-device form; nccl left out without CUDA
    try:
        return float(nd.reduce_dict({"x": float(rank)}, average=False)["x"])
    finally:
        nd.shutdown_dist()


def test_seed_functions_on_the_originals_edge_cases() -> None:
    for seen in run_group(_edges, 2, init="env", timeout=90):
        assert seen["detached"] == [False, False]
        assert seen["values"] == [[1.0, 1.0], [2.0, 2.0]]
        assert seen["not_cloned"]
        assert seen["parameter"] == (True, [3.0, 3.0], True)
        assert seen["scalars"] == [2.0, 4.0] and seen["vectors"] == [2.0, 2.0, 0.0]
        assert seen["async_reduce"] == [2.0] and seen["async_gather"] == [0, 1]


def test_init_dist_takes_torchs_per_device_backend_form() -> None:
    assert run_group(_per_device_backend, 2, init="env") == [1.0, 1.0]


def test_all_gather_in_one_process_returns_the_object_itself() -> None:
    """detectron2's and seed 000's all_gather return [data] in one process: no deep copy, so
    a non-leaf tensor that requires grad, a lock or a generator all work."""
    for data in (
        torch.ones(2, requires_grad=True) * 2,
        {"lock": threading.Lock()},
        (i for i in range(3)),
    ):
        gathered = nd.all_gather(data)
        assert len(gathered) == 1 and gathered[0] is data
        assert nd.all_gather(data, safe_clone=False)[0] is data


def _outside_the_group(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from nn_handler.distributed.communicator import TorchCommunicator
    from nn_handler.errors import DistributedError

    only_rank_0 = dist.new_group([0])  # every rank must call new_group
    if rank == 0:
        return str(TorchCommunicator(only_rank_0).world_size)
    try:
        TorchCommunicator(only_rank_0)
    except DistributedError as error:
        return str(error)
    return "no error"


def test_a_communicator_on_a_group_this_rank_is_not_in_is_refused() -> None:
    inside, outside = run_group(_outside_the_group, 2)
    assert inside == "1"
    assert "global rank 1 is not a member of the group passed to TorchCommunicator" in outside
