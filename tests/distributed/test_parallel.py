"""ParallelExecutor and friends: one process per device, tested on CPU with devices=[cpu, cpu]."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from nn_handler.errors import ConfigError, WorkerFailedError, WorkerTimeoutError
from nn_handler.utils.ddp_decorators import (
    ParallelExecutor,
    parallel_on_all_devices,
    parallelize_on_gpus,
)
from tests.conftest import cuda_only
from tests.timeouts import scaled_now

pytestmark = pytest.mark.distributed
CPUS = ["cpu", "cpu"]


#: How long a surviving worker sleeps after its peer failed: far past any start under load.
SURVIVOR_S = 120


def heavy_computation(device: torch.device, data: torch.Tensor) -> tuple[str, list[int], int]:
    return str(device), (data.to(device) * 2).tolist(), os.getpid()


def test_results_come_back_in_device_order_from_separate_processes() -> None:
    with ParallelExecutor(devices=CPUS, timeout=60) as executor:
        results = executor.run(heavy_computation, torch.tensor([1, 2, 3]))
    assert [r[:2] for r in results] == [("cpu", [2, 4, 6])] * 2
    pids = {r[2] for r in results}
    assert len(pids) == 2 and os.getpid() not in pids


def test_the_device_is_passed_by_keyword_or_not_at_all() -> None:
    def keyword_style(x: int, y: int, device: torch.device | None = None) -> str:
        return f"{x + y} on {device}"

    executor = ParallelExecutor(devices=CPUS, timeout=60)
    assert executor.run(keyword_style, 1, y=2) == ["3 on cpu", "3 on cpu"]
    plain = ParallelExecutor(devices=["cpu"], pass_device=False, timeout=60)
    assert plain.run(lambda x: x * 3, 7) == [21], "lambdas travel with cloudpickle"


def test_without_gpus_num_gpus_none_runs_once_on_the_cpu_with_a_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")

    @parallelize_on_gpus()
    def process_on_gpu(device: torch.device, data: torch.Tensor) -> torch.Tensor:
        return data.to(device) * 2

    with pytest.warns(RuntimeWarning, match="running the function once on the CPU"):
        results = process_on_gpu(torch.tensor([1, 2, 3]))
    assert len(results) == 1 and results[0].tolist() == [2, 4, 6]


def test_more_gpus_than_available_is_a_config_error_naming_the_count() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=rf"num_gpus={count + 1} but {count} CUDA device"):
        ParallelExecutor(num_gpus=count + 1)


def test_a_function_without_a_device_parameter_is_named() -> None:
    def no_device(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="no_device takes no 'device' parameter"):
        ParallelExecutor(devices=["cpu"]).run(no_device, 1)


def _second_fails(device: torch.device) -> int:
    if _is_second():
        raise ValueError("simulated failure on the second device")
    time.sleep(SURVIVOR_S)
    return 0


def _is_second() -> bool:
    return os.environ["NN_HANDLER_WORKER_INDEX"] == "1"


def test_a_worker_that_raises_names_its_device_index_and_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        ParallelExecutor(devices=CPUS, timeout=60).run(_second_fails)
    # Below the survivor's sleep whatever the machine's load: a terminated survivor.
    assert time.monotonic() - start < min(scaled_now(20), SURVIVOR_S - 10)
    assert info.value.unit == "device" and list(info.value.failed) == [1]
    text = str(info.value)
    assert "failed on device(s) [1]" in text and "simulated failure on the second device" in text
    assert isinstance(info.value.__cause__, ValueError)


def _killed_hard(device: torch.device) -> int:
    if _is_second():
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_worker_killed_hard_makes_run_raise() -> None:
    with pytest.raises(WorkerFailedError, match="killed by SIGKILL"):
        ParallelExecutor(devices=CPUS, timeout=60).run(_killed_hard)


def _sleeps(device: torch.device) -> None:
    time.sleep(600)


def test_a_hanging_worker_is_killed_at_the_timeout() -> None:
    with pytest.raises(WorkerTimeoutError) as info:
        ParallelExecutor(devices=CPUS, timeout=6).run(_sleeps)
    assert info.value.running == [0, 1] and info.value.unit == "device"


def test_parallel_on_all_devices_calls_the_function_directly_without_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")

    @parallel_on_all_devices
    def forward(chunk: torch.Tensor) -> torch.Tensor:
        return chunk * 2 + torch.ones(1, device=chunk.device)

    assert forward(torch.ones(4, 2)).tolist() == [[3.0, 3.0]] * 4


@pytest.mark.gpu
@cuda_only
def test_parallel_executor_and_data_parallel_on_cuda() -> None:
    results = ParallelExecutor(num_gpus=1, timeout=120).run(heavy_computation, torch.arange(3))
    assert results[0][:2] == ("cuda:0", [0, 2, 4])

    @parallel_on_all_devices
    def forward(chunk: torch.Tensor) -> torch.Tensor:
        return chunk * 2

    out = forward(torch.ones(8, 3, device="cuda:0"))
    assert out.device == torch.device("cuda", 0) and out.shape == (8, 3)
