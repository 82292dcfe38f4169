"""The reproducible mode on a CUDA device: a group of one and a gloo group of two ranks (both
on cuda:0, the one GPU a test machine has) train the CNN and the transformer block to the same
SHA-256 of weights, buffers, optimizer state and History, in fp32 and in bf16; sharded by FSDP2
over an nccl group of one (its int64 reduce-scatter really runs) they end with the replicated
rank's SHA-256 in fp32, and train in bf16 (BatchNorm included); and the mode refuses CUDA
without deterministic kernels, except with a float sum (which promises no bits). Skipped
cleanly without CUDA. (FSDP2 over gloo with CUDA tensors is not a torch configuration: two
ranks on the one GPU crashed in it, so the sharded layouts' agreement across world sizes is
tested on gloo CPU groups, tests/distributed/test_reproducible_sharded.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nn_handler import DistributedConfig, DistributedContext, NNHandler
from nn_handler.errors import ConfigError
from tests.conftest import cuda_only
from tests.harness import run_group
from tests.reproducible_helpers import (
    WORKLOADS,
    config,
    digest,
    full_digest,
    sharded,
    train,
)

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, cuda_only]

#: cuBLAS's deterministic workspace (torch.use_deterministic_algorithms asks for it).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _handler(
    name: str,
    context: DistributedContext,
    precision: str,
    reduction: str = "exact",
    **trainer: Any,
) -> NNHandler:
    model = WORKLOADS[name][0]
    return NNHandler(
        model(),
        lambda p: torch.optim.Adam(p, lr=3e-3),
        torch.nn.CrossEntropyLoss(),
        config={**config(name, reduction=reduction, **trainer), "precision": precision},
        context=context,
    )


def _digests(rank: int, world_size: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    context = DistributedContext(DistributedConfig(device="cuda:0", backend="gloo")).setup()
    out: dict[str, Any] = {}
    for name in WORKLOADS:
        for precision in ("32", "bf16"):
            with _handler(name, context, precision) as h:
                train(h, name)
                assert next(h.model.parameters()).device == torch.device("cuda", 0)
                out[f"{name}-{precision}"] = digest(h)
    return out


def test_cuda_gives_the_same_bits_at_world_sizes_1_and_2() -> None:
    runs = {w: run_group(_digests, w, env=DETERMINISTIC_ENV, timeout=300) for w in (1, 2)}
    for key in runs[1][0]:
        seen = {(w, rank): result[key] for w, group in runs.items()
                for rank, result in enumerate(group)}  # fmt: skip
        assert len(set(seen.values())) == 1, (key, seen)
    assert runs[1][0]["cnn-32"] != runs[1][0]["cnn-bf16"]  # bf16 really ran


def _sharded_digests(rank: int, world_size: int) -> dict[str, str]:
    """fp32: replicated and sharded by FSDP2 over an nccl group of one; bf16: sharded."""
    torch.use_deterministic_algorithms(True)
    config = DistributedConfig(device="cuda:0", backend="nccl", enabled=True)
    context = DistributedContext(config).setup()
    out: dict[str, str] = {}
    for name in WORKLOADS:
        for layout, settings in {"fsdp": sharded(name, {}), "replicated": {}}.items():
            precisions = ("32", "bf16") if layout == "fsdp" else ("32",)
            for precision in precisions:
                with _handler(name, context, precision, **settings) as h:
                    train(h, name)
                    out[f"{name}-{layout}-{precision}"] = full_digest(h)
    return out


def test_cuda_sharded_by_fsdp2_gives_the_bits_of_one_replicated_rank() -> None:
    one = run_group(_sharded_digests, 1, init="env", env=DETERMINISTIC_ENV, timeout=300)[0]
    for name in WORKLOADS:
        assert one[f"{name}-fsdp-32"] == one[f"{name}-replicated-32"], name
        assert one[f"{name}-fsdp-bf16"] != one[f"{name}-fsdp-32"]  # bf16 really ran


def test_cuda_without_deterministic_kernels_is_refused_unless_the_sum_is_float() -> None:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        context = DistributedContext(DistributedConfig(device="cuda:0", enabled=False))
        with pytest.raises(ConfigError, match="use_deterministic_algorithms"):
            _handler("cnn", context, "32")
        with _handler("cnn", context, "32", reduction="float") as h:  # promises no bits
            train(h, "cnn")
            assert len(h.history) == 2
    finally:
        torch.use_deterministic_algorithms(was)
