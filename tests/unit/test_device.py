"""Device resolution: every branch with simulated hardware, then the real machine."""

from __future__ import annotations

import pytest
import torch

from nn_handler.distributed.device import Hardware, resolve_device, resolve_device_spec
from nn_handler.errors import ConfigError
from nn_handler.utils.ddp import _resolve_device
from tests.conftest import cuda_only

NO_GPU = Hardware()
FOUR_GPUS = Hardware(cuda_device_count=4)
MAC = Hardware(mps_available=True)


@pytest.mark.parametrize(
    ("spec", "local_rank", "hardware", "expected"),
    [
        ("auto", None, NO_GPU, "cpu"),
        ("auto", 2, FOUR_GPUS, "cuda:2"),
        ("auto", None, MAC, "mps"),
        ("cpu", 3, FOUR_GPUS, "cpu"),
        ("cuda", 3, FOUR_GPUS, "cuda:3"),
        ("gpu", None, FOUR_GPUS, "cuda:0"),
        ("GPU", 1, FOUR_GPUS, "cuda:1"),
        ("cuda:2", 0, FOUR_GPUS, "cuda:2"),
        (torch.device("cuda"), 1, FOUR_GPUS, "cuda:1"),
        (torch.device("cuda", 3), 0, FOUR_GPUS, "cuda:3"),
        ("mps", None, MAC, "mps"),
        # One visible GPU per process (SLURM --gpus-per-task): every local rank uses cuda:0.
        ("cuda", 3, Hardware(cuda_device_count=1), "cuda:0"),
    ],
)
def test_device_specs_resolve(
    spec: str | torch.device, local_rank: int | None, hardware: Hardware, expected: str
) -> None:
    assert resolve_device_spec(spec, local_rank, hardware) == torch.device(expected)


@pytest.mark.parametrize("spec", ["cuda", "gpu", "cuda:1", torch.device("cuda"), "mps"])
def test_a_missing_accelerator_falls_back_to_cpu_with_a_warning(spec: str) -> None:
    with pytest.warns(RuntimeWarning, match="falling back to CPU"):
        assert resolve_device_spec(spec, 0, NO_GPU) == torch.device("cpu")


def test_an_index_beyond_the_device_count_names_the_count() -> None:
    with pytest.raises(ConfigError, match=r"'cuda:4' does not exist: 4 CUDA device\(s\)"):
        resolve_device_spec("cuda:4", None, FOUR_GPUS)


def test_a_local_rank_beyond_the_gpus_names_both() -> None:
    with pytest.raises(ConfigError, match="local rank 5 needs GPU 5 but only 4"):
        resolve_device_spec("cuda", 5, FOUR_GPUS)


@pytest.mark.parametrize(
    ("spec", "culprit"), [("tpu", "unknown device 'tpu'"), ("cuda:x", "index"), (3, "int")]
)
def test_unknown_specs_are_config_errors(spec: object, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        resolve_device_spec(spec, None, FOUR_GPUS)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_on_this_cpu_machine_cuda_falls_back_to_cpu() -> None:
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        assert _resolve_device("cuda") == torch.device("cpu")
    assert resolve_device("auto") in (torch.device("cpu"), torch.device("mps"))


def test_seed_resolve_device_uses_the_launchers_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls: FOUR_GPUS))
    assert _resolve_device("cuda") == torch.device("cuda", 1)


@pytest.mark.gpu
@cuda_only
def test_cuda_resolves_on_a_real_gpu() -> None:
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"{count} CUDA device"):
        resolve_device(f"cuda:{count}")


@pytest.mark.parametrize("spec", ["cuda:\u0663", "cuda:\u00b2"])
def test_non_ascii_digits_are_not_cuda_indices(spec: str) -> None:
    with pytest.raises(ConfigError, match="index"):
        resolve_device_spec(spec, None, FOUR_GPUS)
