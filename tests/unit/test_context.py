"""DistributedContext in one process: lifecycle, adoption, and errors raised before any socket."""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from nn_handler import DistributedConfig, DistributedContext, NullCommunicator, TorchCommunicator
from nn_handler.distributed import shutdown_dist
from nn_handler.errors import ConfigError, DistributedError


def test_single_process_needs_no_process_group() -> None:
    with DistributedContext() as ctx:
        assert isinstance(ctx.communicator, NullCommunicator)
        assert not ctx.is_distributed and not dist.is_initialized()
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
    ctx.teardown()  # idempotent


def test_a_config_dict_is_validated_like_the_config() -> None:
    context = DistributedContext({"stall_timeout": None, "timeout": 90})
    assert context.config.stall_timeout is None and context.config.timeout.total_seconds() == 90
    with pytest.raises(ConfigError, match=r"stall_timout.*did you mean 'stall_timeout'"):
        DistributedContext({"stall_timout": 3})


def test_communicator_before_setup_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="call setup"):
        _ = DistributedContext().communicator


def test_enabled_creates_a_group_of_one_and_teardown_destroys_it() -> None:
    ctx = DistributedContext(DistributedConfig(enabled=True)).setup()
    assert dist.is_initialized() and isinstance(ctx.communicator, TorchCommunicator)
    assert ctx.communicator.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    ctx.teardown()
    assert not dist.is_initialized()
    ctx.teardown()


def test_an_existing_group_is_adopted_and_left_alone() -> None:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    ctx = DistributedContext().setup()
    assert isinstance(ctx.communicator, TorchCommunicator)
    ctx.teardown()
    assert dist.is_initialized(), "teardown destroys only what the context created"


def test_an_existing_group_that_contradicts_the_launcher_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError, match="rank 0 of 1, but the torchrun environment"):
        DistributedContext().setup()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_nccl_without_cuda_suggests_gloo_at_construction() -> None:
    with pytest.raises(ConfigError, match="backend='gloo'"):
        DistributedContext(DistributedConfig(backend="nccl"))


def test_inconsistent_environment_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK=3 is not below WORLD_SIZE=2"):
        DistributedContext()


def test_no_rendezvous_address_is_named_before_any_socket_opens() -> None:
    ctx = DistributedContext(rank=0, world_size=2, env={})
    with pytest.raises(ConfigError, match="set MASTER_ADDR and MASTER_PORT"):
        ctx.setup()
    assert not dist.is_initialized()


def test_a_failed_rendezvous_is_a_distributed_error_naming_the_address() -> None:
    config = DistributedConfig(init_method="bogus://nowhere")
    ctx = DistributedContext(config, rank=0, world_size=2, env={})
    with pytest.raises(DistributedError, match="bogus://nowhere"):
        ctx.setup()


def test_the_configured_timeout_reaches_the_process_group() -> None:
    config = DistributedConfig(enabled=True, timeout=timedelta(seconds=123))
    with DistributedContext(config):
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        assert backend.options._timeout == timedelta(seconds=123)


def test_the_debug_flag_in_the_config_reaches_the_communicator() -> None:
    with DistributedContext(DistributedConfig(debug_collectives=True)) as ctx:
        assert ctx.communicator.debug
    with DistributedContext(DistributedConfig(enabled=True, debug_collectives=True)) as ctx:
        assert isinstance(ctx.communicator, TorchCommunicator) and ctx.communicator.debug


def _ddp_in_a_cycle() -> weakref.ref[torch.nn.Module]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    model.cycle = [model]  # type: ignore[assignment]  # unreachable after return, but not freed
    return weakref.ref(model)


@pytest.mark.parametrize("close", ["teardown", "shutdown_dist"])
def test_unreachable_ddp_modules_are_freed_before_the_group_is_destroyed(close: str) -> None:
    # Freed after its group is gone, a DDP reducer aborts the process at exit (SIGABRT).
    ctx = DistributedContext(DistributedConfig(enabled=True)).setup()
    gc.disable()
    try:
        ref = _ddp_in_a_cycle()
        assert ref() is not None, "only the garbage collector can free it"
        ctx.teardown() if close == "teardown" else shutdown_dist()
        assert ref() is None
        assert not dist.is_initialized()
    finally:
        gc.enable()
