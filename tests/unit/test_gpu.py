"""What needs a CUDA device: nccl with world size 1, CUDA collectives, the memory printers.

Skipped cleanly on machines without CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nn_handler import DistributedConfig, DistributedContext, TorchCommunicator
from nn_handler import distributed as nd
from nn_handler.errors import ConfigError
from tests import communicator_contract as contract
from tests.conftest import cuda_only

pytestmark = [pytest.mark.gpu, cuda_only]


def test_nccl_group_of_one_meets_the_contract_on_cuda() -> None:
    config = DistributedConfig(enabled=True, backend="nccl", device="cuda")
    with DistributedContext(config) as ctx:
        comm = ctx.communicator
        assert isinstance(comm, TorchCommunicator) and comm.backend == "nccl"
        assert comm.device == torch.device("cuda", 0)
        contract.run_all(comm)
        on_gpu = torch.arange(4.0, device="cuda")
        assert comm.all_reduce(on_gpu).device == on_gpu.device
        assert comm.all_gather(on_gpu)[0].device == on_gpu.device


def test_auto_backend_is_nccl_on_cuda() -> None:
    assert DistributedContext(DistributedConfig(device="cuda")).backend == "nccl"


def test_memory_printers_report_a_real_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    keep = torch.empty(1024, 1024, device="cuda")
    nd.print_gpu_memory_usage(0)
    nd.print_gpu_memory_stats(torch.device("cuda", 0))
    out = capsys.readouterr().out
    assert "cuda:0 memory: allocated" in out and "MiB" in out
    assert "memory statistics" in out and "driver free" in out
    del keep
    with pytest.raises(ConfigError, match="does not exist"):
        nd.print_gpu_memory_usage(torch.cuda.device_count())


@pytest.mark.parametrize("mode", ["distributed", "rank_cached"])
def test_loaders_pin_memory_for_cuda(mode: str) -> None:
    from torch.utils.data import TensorDataset

    from nn_handler import LoaderConfig, LoaderFactory
    from nn_handler.distributed.env import DistributedInfo

    factory = LoaderFactory(
        LoaderConfig(batch_size=4, mode=mode), DistributedInfo(), torch.device("cuda", 0)
    )
    assert factory.settings["pin_memory"] is True
    (batch,) = next(iter(factory.train_loader(TensorDataset(torch.randn(16, 3)))))
    assert batch.is_pinned()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "amp"])
def test_handler_trains_on_cuda_in_reduced_precision(precision: str) -> None:
    from torch import nn

    from nn_handler import NNHandler
    from tests.training_helpers import mlp, regression_data, sgd

    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={
            "distributed": {"device": "cuda"},
            "precision": precision,
            "ema": {"enabled": True},
            "trainer": {"gradient_clip_val": 1.0},
        },
    ) as handler:
        history = handler.train(regression_data(), regression_data(n=10), epochs=2)
        assert handler.trainer.precision.name == ("fp16" if precision == "amp" else precision)
        assert (handler.trainer.precision.scaler is not None) == (precision != "bf16")
        assert next(handler.model.parameters()).device.type == "cuda"
        assert torch.isfinite(torch.tensor(history["train_loss"])).all()
        assert handler.predict(regression_data(n=10)).shape == (10, 3)


def test_a_cuda_checkpoint_resumes_exactly_on_cuda_and_loads_on_cpu(tmp_path: Any) -> None:
    """fp16 + GradScaler + CUDA RNG state: resume on CUDA is exact, and the same file loads on
    a CPU machine (weights-only, mapped to the CPU)."""
    from torch import nn

    from nn_handler import NNHandler
    from nn_handler.checkpoint import load_file, load_model_state
    from tests.training_helpers import mlp, regression_data, sgd

    config = {
        "distributed": {"device": "cuda"},
        "precision": "fp16",
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(tmp_path), "every_n_steps": 2, "keep_last": 10},
    }
    data = regression_data(n=160)  # 5 steps an epoch: the resume below is mid-epoch
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as full:
        full.train(data, epochs=2)
        expected = {k: v.cpu() for k, v in full.model.state_dict().items()}
    with NNHandler(mlp(seed=3), sgd, nn.CrossEntropyLoss(), config=config) as again:
        again.resume(tmp_path / "ckpt-e0000-s00000002.pt")
        again.train(data, epochs=2)
        resumed = {k: v.cpu() for k, v in again.model.state_dict().items()}
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    checkpoint = load_file(tmp_path / "ckpt-e0002-s00000010.pt")
    assert checkpoint["model"]["0.weight"].device.type == "cpu"
    assert checkpoint["ranks"][0]["rng"]["cuda"]  # the CUDA generator state was saved
    load_model_state(mlp(), checkpoint["model"])


def _fsdp_on_cuda(folder: Any, **checkpoint: Any) -> Any:
    from torch import nn

    from nn_handler import NNHandler
    from tests.training_helpers import mlp, sgd

    config = {
        "distributed": {"enabled": True, "backend": "nccl", "device": "cuda"},
        "precision": "bf16",
        "ema": {"enabled": True, "decay": 0.9},
        "trainer": {"progress_bar": False, "strategy": "fsdp", "fsdp": {"blocks": ["Linear"]}},
        "checkpoint": {"dir": str(folder), "resume": "never", "keep_last": 3, **checkpoint},
    }
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config)


def _whole(handler: Any) -> dict[str, torch.Tensor]:
    """The sharded model's whole state, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(get_model_state_dict(handler.trainer.module, options=options))


def test_fsdp2_trains_in_bf16_over_nccl_and_resumes_from_an_async_sharded_checkpoint(
    tmp_path: Any,
) -> None:
    """FSDP2 on a CUDA device with nccl (a group of one), bf16 through its
    MixedPrecisionPolicy, a sharded EMA, checkpoints saved in the background through DCP on a
    gloo side group; an exact resume, and a consolidated file that loads on the CPU."""
    from torch import nn

    from nn_handler import NNHandler
    from nn_handler.checkpoint.consolidate import consolidate
    from tests.training_helpers import max_difference, mlp, regression_data

    inside: set[torch.dtype] = set()
    with _fsdp_on_cuda(tmp_path / "run", async_save=True) as handler:
        block = next(m for m in handler.trainer.module.modules() if isinstance(m, nn.Linear))
        block.register_forward_pre_hook(lambda m, _: inside.add(m.weight.dtype))
        handler.train(regression_data(), regression_data(n=10), epochs=3)
        shard = next(handler.trainer.module.parameters())
        assert shard.device.type == "cuda" and shard.dtype == torch.float32
        straight = _whole(handler)
    assert inside == {torch.bfloat16}
    first = next((tmp_path / "run").glob("ckpt-e0001-*"))
    with _fsdp_on_cuda(tmp_path / "again") as handler:
        handler.trainer.resume(first)
        handler.train(regression_data(), regression_data(n=10), epochs=3)
        again = _whole(handler)
    assert max_difference(again, straight) == 0.0
    last = next((tmp_path / "run").glob("ckpt-e0003-*"))
    out = consolidate(last, tmp_path / "model.pt")
    with NNHandler.load(out, mlp(seed=5), config={"distributed": {"device": "cpu"}}) as cpu:
        assert max_difference(dict(cpu.model.state_dict()), straight) == 0.0
