"""Every seed function in one process: the single-process answer, or the documented error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nn_handler import distributed as nd
from nn_handler.errors import ConfigError, DistributedError
from nn_handler.utils import dd_helpers, ddp


def test_seed_000_names_give_the_single_process_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert (nd.get_world_size(), nd.get_rank(), nd.is_main_process()) == (1, 0, True)
    nd.synchronize()
    assert nd.create_local_process_group(1) is None and nd.get_local_process_group() is None
    assert (nd.get_local_rank(), nd.get_local_size()) == (0, 1)
    data = {"preds": [1, 2]}
    assert nd.all_gather(data)[0] is data, "[data] in one process, as the originals"
    assert nd.all_gather(data, safe_clone=False)[0] is data
    assert nd.gather(data) == [data]
    assert nd.reduce_dict({"loss": torch.tensor(2.0)}) == {"loss": torch.tensor(2.0)}
    # As detectron2's: in one process the very dict comes back (unsorted, its ints intact).
    counts = {"b": torch.tensor(3), "a": 1}
    assert nd.reduce_dict(counts) is counts and list(counts) == ["b", "a"]
    assert 0 <= nd.shared_random_seed() < 2**31
    nd.print_gpu_memory_usage(0)
    nd.print_gpu_memory_stats(0)
    if not torch.cuda.is_available():
        assert capsys.readouterr().out.count("CUDA is not available") == 2


def test_seed_000_local_group_size_must_divide_the_world() -> None:
    with pytest.raises(ConfigError, match="world size 1 is not a multiple"):
        nd.create_local_process_group(2)
    with pytest.raises(ConfigError, match="positive int"):
        nd.create_local_process_group(0)


def test_seed_004_names_give_the_single_process_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert not nd.is_using_torchrun() and not nd.is_dist_active()
    assert nd.get_dist_info() == nd.DistributedInfo()
    assert (nd.get_global_rank(), nd.get_local_world_size()) == (0, 1)
    nd.global_print("on rank 0")
    nd.global_print("not here", global_rank=1)
    nd.local_print("local 0")
    nd.local_print("not here either", local_rank=3)
    assert capsys.readouterr().out == "on rank 0\nlocal 0\n"
    nd.safe_barrier()
    nd.shutdown_dist()  # nothing to shut down: a no-op


def test_seed_004_tensor_helpers_raise_runtime_error_when_not_initialised() -> None:
    with pytest.raises(RuntimeError, match="init_dist"):
        nd.gather_into_tensor(torch.ones(2), (2,))
    with pytest.raises(DistributedError, match="all_reduce_tensors needs an initialised"):
        nd.all_reduce_tensors(torch.ones(2))


def test_safe_barrier_is_callable_in_any_state() -> None:
    nd.safe_barrier(async_op=True)  # seed 004: valid whether distributed or not
    nd.safe_barrier(group=None, device_ids=[0], timeout=5)
    with pytest.raises(ConfigError, match="'tag'"):
        nd.safe_barrier(tag=3)


def test_init_dist_needs_both_rank_and_world_size() -> None:
    with pytest.raises(ValueError, match="rank=0, world_size=None"):
        nd.init_dist("gloo", rank=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_init_dist_default_nccl_without_cuda_suggests_gloo() -> None:
    with pytest.raises(ConfigError, match="backend='gloo'"):
        nd.init_dist()


def test_init_dist_in_one_process_makes_a_group_of_one() -> None:
    nd.init_dist("gloo")
    assert nd.is_dist_active() and nd.get_world_size() == 1
    assert nd.gather_into_tensor(torch.arange(3), (3,)).tolist() == [0, 1, 2]
    t = torch.tensor([1.0, 2.0])
    assert nd.all_reduce_tensors(t) is t
    assert nd.all_reduce_tensors([torch.ones(1), torch.zeros(2)]).tolist() == [1.0, 0.0, 0.0]
    nd.init_dist("gloo")  # already initialised: a no-op
    nd.shutdown_dist()
    assert not dist.is_initialized()
    nd.shutdown_dist()


def test_seed_002_initialize_ddp_and_should_use_distributed() -> None:
    expected_device = nd.resolve_device("auto", 0)
    # rouzib/NNHandler's one-process answer: local rank -1 (no launcher gave one).
    assert ddp.initialize_ddp() == (False, 0, -1, 1, expected_device)
    from nn_handler import initialize_ddp  # exported at the top level, as the original

    assert initialize_ddp is ddp.initialize_ddp
    assert not ddp._should_use_distributed(False)
    assert not ddp._should_use_distributed(None)
    with pytest.warns(RuntimeWarning, match="not started by a multi-process launcher"):
        assert not ddp._should_use_distributed(True)


def test_seed_002_should_use_distributed_reads_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ddp._should_use_distributed(None) and ddp._should_use_distributed(True)
    assert not ddp._should_use_distributed(False)


def test_seed_001_helpers_in_one_process() -> None:
    cpu = torch.device("cpu")
    metrics = dd_helpers.aggregate_metrics({"acc": 0.5, "f1": float("nan")}, 1, cpu)
    assert metrics["acc"] == 0.5 and math.isnan(metrics["f1"])
    assert dd_helpers.aggregate_loss(0.25, 1, cpu) == 0.25
    assert dd_helpers.aggregate_loss(torch.tensor(0.5), 1, cpu) == 0.5
    assert dd_helpers.broadcast_data({"cfg": 1}) == {"cfg": 1}
    assert dd_helpers.broadcast_if_ddp([1, 2]) == [1, 2]


def test_seed_001_world_size_that_disagrees_with_the_group_is_named() -> None:
    with pytest.raises(ConfigError, match="world_size=2 but the process group has 1"):
        dd_helpers.aggregate_metrics({"acc": 1.0}, 2, torch.device("cpu"))
