"""The ThroughputMonitor in one process: its rates against an independent clock, the step
anatomy and its verdict (a slow dataset is data-bound, a slow model is not), checkpoint
stalls, measured FLOPs and MFU, the peak table, peak memory; and the profiler's traces."""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from nn_handler import Hook, NNHandler, ThroughputMonitor
from nn_handler.errors import ConfigError
from nn_handler.monitoring import PEAK_TFLOPS, peak_tflops, reset_peak_memory
from tests.training_helpers import mlp, regression_data, sgd

FEATURES = 6


class SlowModel(nn.Module):
    """A linear layer whose forward also sleeps: a step of known length."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(FEATURES, 3)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample takes ``seconds`` to load."""

    def __init__(self, n: int, seconds: float) -> None:
        self.data = regression_data(n=n)
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.seconds)
        x, y = self.data[index]
        return x, y


class EpochClock(Hook):
    """An independent clock: each epoch's seconds from its first to its last hook point."""

    order = -100

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[float] = []
        self.ends: list[float] = []

    def before_epoch(self) -> None:
        self.starts.append(time.perf_counter())

    def after_step(self) -> None:
        self.last = time.perf_counter()

    def after_epoch(self) -> None:
        self.ends.append(self.last)

    def seconds(self) -> list[float]:
        return [end - start for start, end in zip(self.starts, self.ends, strict=True)]


def _run(
    model: nn.Module,
    data: Any,
    *hooks: Hook,
    epochs: int = 2,
    batch_size: int = 4,
    log_file: Path | None = None,
    **config: Any,
) -> NNHandler:
    settings: dict[str, Any] = {
        "loader": {"batch_size": batch_size, "shuffle": False},
        "trainer": {"progress_bar": False},
        **config,
    }
    if log_file is not None:
        settings["logging"] = {"file": str(log_file), **settings.get("logging", {})}
    with NNHandler(model, sgd, nn.CrossEntropyLoss(), config=settings, hooks=hooks) as handler:
        handler.train(data, epochs=epochs)
    return handler


def test_throughput_agrees_with_samples_over_wall_time() -> None:
    clock = EpochClock()
    monitor = ThroughputMonitor(count_tokens=lambda batch: batch[0].numel())
    n, batch = 200, 4  # 50 steps of at least 10 ms an epoch
    handler = _run(SlowModel(0.01), regression_data(n=n), clock, monitor, batch_size=batch)
    for record, seconds in zip(handler.history.records, clock.seconds(), strict=True):
        truth = n / seconds
        assert record["samples_per_sec"] == pytest.approx(truth, rel=0.05)
        assert record["tokens_per_sec"] / FEATURES == pytest.approx(truth, rel=0.05)
        assert record["tokens_per_sec_rank"] == record["tokens_per_sec"]  # one rank
        # A step is at least the model's 10 ms sleep, and most of it (on a loaded machine the
        # loader's share grows: bounds the verdict's 50% keeps, not the quiet machine's 99%).
        assert record["step_ms"] >= 10.0
        assert record["compute_pct"] > 50.0 > record["data_wait_pct"]
    assert monitor.last_verdict is None  # compute-bound: nothing to say
    assert "samples_per_sec_rank" not in handler.history.last  # the same as the global one


def test_a_slow_dataset_is_reported_data_bound(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    monitor = ThroughputMonitor()
    handler = _run(mlp(), SlowDataset(n=40, seconds=0.02), monitor, log_file=log)
    record = handler.history.last
    # 80 ms of loading a step against a tiny model's step: data-bound by the verdict's rule
    # (at least half the step) even on a loaded machine (68% was seen with 40 ms).
    assert record["data_wait_pct"] > 50.0 > record["compute_pct"]
    assert monitor.last_verdict is not None
    assert monitor.last_verdict.startswith("data-bound: ")
    assert "of the step waiting for batches; raise num_workers" in monitor.last_verdict
    lines = [line for line in log.read_text().splitlines() if "epoch 2/2" in line]
    assert len(lines) == 1 and lines[0].endswith(monitor.last_verdict)


def test_checkpoint_stalls_are_counted_apart_from_data_waits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(FEATURES, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3))
    checkpoint = {"dir": str(tmp_path / "ckpt"), "every_n_steps": 1, "keep_last": 1}
    handler = _run(big, regression_data(), checkpoint=checkpoint)
    record = handler.history.last
    # A 4 MB checkpoint every step is most of this step; none of it is waiting for data.
    assert record["checkpoint_pct"] > 30.0
    assert record["checkpoint_pct"] > 3 * record["data_wait_pct"]
    # The parts are shares of one wall time, the last step's checkpoint included in both.
    parts = record["checkpoint_pct"] + record["compute_pct"] + record["data_wait_pct"]
    assert parts <= 100.5, record
    no_checkpoints = _run(mlp(), regression_data())
    assert "checkpoint_pct" not in no_checkpoints.history.last


def test_flops_per_sample_are_measured_once_and_give_tflops_and_mfu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 20, bias=False), nn.Linear(20, 5, bias=False))
    monitor = ThroughputMonitor(peak_tflops=0.5)
    handler = _run(model, regression_data(), monitor)
    # Forward 2*(6*20 + 20*5) = 440; backward: both weight gradients (440) and the second
    # layer's input gradient (2*20*5 = 200); the data needs no gradient. Per sample: 1080.
    assert monitor.flops_per_sample == 1080
    for record in handler.history.records:
        assert record["tflops"] == pytest.approx(1080 * 4000.0 / record["step_ms"] / 1e12, rel=1e-9)
        assert record["mfu_pct"] == pytest.approx(100.0 * record["tflops"] / 0.5, rel=1e-12)


def test_flops_and_peak_given_in_the_config_are_used_as_given() -> None:
    handler = _run(
        mlp(), regression_data(), logging={"flops_per_sample": 1e9, "peak_tflops": 100.0}
    )
    record = handler.history.last
    rate = 4 * 1000.0 / record["step_ms"]
    assert record["tflops"] == pytest.approx(1e9 * rate / 1e12, rel=1e-9)
    assert record["mfu_pct"] == pytest.approx(record["tflops"], rel=1e-12)  # 100 TFLOP/s peak


def test_monitor_off_leaves_the_record_as_the_trainer_makes_it() -> None:
    handler = _run(mlp(), regression_data(), logging={"monitor": False})
    assert not {"step_ms", "data_wait_pct", "peak_mem_mb"} & set(handler.history.last)
    on = _run(mlp(), regression_data())
    assert {"step_ms", "data_wait_pct", "compute_pct", "peak_mem_mb"} <= set(on.history.last)
    assert "mfu_pct" not in on.history.last  # no peak known for a CPU
    assert "exposed_comm_pct" not in on.history.last  # nothing reduced in one process


@pytest.mark.parametrize(
    "options", [{"flops_per_sample": 0.0}, {"peak_tflops": -1.0}], ids=["flops", "peak"]
)
def test_bad_monitor_options_are_config_errors(options: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        ThroughputMonitor(**options)


def test_peak_memory_follows_each_epoch() -> None:
    class Allocate(Hook):
        def before_step(self) -> None:
            if self.trainer.state.epoch == 1 and not hasattr(self, "block"):
                # 64 MiB of fresh pages, touched: an anonymous mapping (a tensor may be served
                # from memory the allocator already holds, resident, which raises no peak).
                self.block = mmap.mmap(-1, 64 * 2**20)
                self.block.write(b"\x01" * len(self.block))

        def after_epoch(self) -> None:
            block = self.__dict__.pop("block", None)
            if block is not None:
                block.close()

    handler = _run(mlp(), regression_data(), Allocate(), epochs=3)
    first, second, third = (r["peak_mem_mb"] for r in handler.history.records)
    assert second > first + 48
    if reset_peak_memory(torch.device("cpu")):  # Linux lets a process reset its peak
        assert third < second - 48


def test_peak_tflops_looks_known_gpus_up(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    assert peak_tflops(torch.device("cpu"), "bf16") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {
        "NVIDIA H100 80GB HBM3": 989.0,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA GeForce GTX 1080": None,
    }
    for name, bf16 in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device, n=name: n)
        assert peak_tflops(cuda, "bf16") == bf16, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device: "NVIDIA H100 80GB HBM3")
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        assert peak_tflops(cuda, "32") == PEAK_TFLOPS["H100"]["fp32"]
        matmul.fp32_precision = "tf32"
        assert peak_tflops(cuda, "32") == PEAK_TFLOPS["H100"]["tf32"]
        assert peak_tflops(cuda, "bf16") == PEAK_TFLOPS["H100"]["bf16"]
    finally:
        matmul.fp32_precision = before


# --------------------------------------------------------------------------- profiler
def test_the_profiler_writes_a_loadable_trace_and_logs_the_top_operators(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    profile = {"dir": str(tmp_path / "profile"), "skip_first": 1, "warmup": 1, "active": 2}
    handler = _run(
        mlp(),
        regression_data(),
        log_file=log,
        epochs=1,
        trainer={"progress_bar": False, "profile": profile},
    )
    (trace,) = sorted((tmp_path / "profile").glob("rank0.step*.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name", "") for event in events}
    assert any("aten::addmm" in name or "aten::linear" in name for name in names)
    text = log.read_text()
    assert text.count("profiler: 2 steps traced to") == 1
    assert "Self CPU" in text and "aten::" in text
    assert handler.history.last["epoch"] == 1.0


def test_a_bad_profiler_sort_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sort_by"):
        NNHandler(
            mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": {"profile": {"sort_by": "x"}}}
        )


def test_tensor_dataset_batches_count_their_samples() -> None:
    data = TensorDataset(torch.randn(30, FEATURES), torch.randint(0, 3, (30,)))
    monitor = ThroughputMonitor(count_tokens=lambda batch: 10)
    handler = _run(mlp(), data, monitor, batch_size=8, epochs=1)
    # 4 batches (8, 8, 8, 6) of 10 "tokens" each, over the monitor's wall time.
    record = handler.history.last
    wall = record["step_ms"] * 4 / 1000.0
    assert record["tokens_per_sec"] == pytest.approx(40 / wall, rel=1e-9)


def test_the_reduction_timer_reports_what_ran_past_the_last_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nn_handler.strategies.reduction_timer import ReductionTimer

    timer = ReductionTimer()
    clock = iter([1.0, 1.5, 1.7, 2.0])  # launch, launch, finish, finish
    monkeypatch.setattr(timer, "_now", lambda: next(clock))
    timer.launched()
    timer.launched()
    timer.finished()
    timer.finished()
    exposed, buckets = timer.take()
    assert exposed == pytest.approx(0.5) and buckets == 2  # 2.0 - 1.5
    assert timer.take() == (0.0, 0)  # nothing since: a micro-batch inside a window


class NoFlops(nn.Module):
    """A step of no counted FLOPs (no matmul or convolution), as an idle rank's step in the
    reproducible mode: FlopCounterMode counts 0."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] * self.scale


def test_a_first_step_of_no_flops_closes_the_counter_once() -> None:
    """The counter closed after the first step is not closed again at the fit's end (it
    raised 'FlopCounter.__exit__ called but mode is None' on the reproducible mode's idle
    ranks)."""
    monitor = ThroughputMonitor()
    handler = _run(NoFlops(), regression_data(n=16), monitor)
    assert monitor.flops_per_sample is None and "tflops" not in handler.history.last


class Logged(Hook):
    """What reaches the experiment trackers (their after_log point)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    def after_log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def test_log_lr_step_writes_every_optimizer_steps_learning_rate() -> None:
    """Lightning's LearningRateMonitor(logging_interval='step'): a per-step schedule's rate at
    each step, under 'lr' (one optimizer of one group)."""
    logged = Logged()
    config = {
        "loader": {"batch_size": 8},
        "trainer": {"progress_bar": False, "scheduler_interval": "step"},
        "logging": {"log_lr": "step"},
    }
    halving = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)  # noqa: E731
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), halving, config=config,
                   hooks=[logged]) as handler:  # fmt: skip
        handler.train(regression_data(n=24), epochs=2)  # 3 steps an epoch
    assert [step for step, _ in logged.rows] == [1, 2, 3, 4, 5, 6]
    assert [row["lr"] for _, row in logged.rows] == [0.1 * 0.5**k for k in range(1, 7)]


def test_learning_rate_names_follow_lightnings() -> None:
    from nn_handler.monitoring.learning_rate import lr_names

    one = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    layer = nn.Linear(2, 2)
    groups = torch.optim.Adam([{"params": [layer.weight]}, {"params": [layer.bias]}])
    assert lr_names([one]) == [["lr"]]
    assert lr_names([groups, one, one]) == [
        ["lr-Adam/pg0", "lr-Adam/pg1"],
        ["lr-SGD"],
        ["lr-SGD-1"],
    ]
