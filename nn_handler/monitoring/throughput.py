"""ThroughputMonitor: samples/s, tokens/s, TFLOP/s and MFU, where each step's time goes, and
peak memory, written into each epoch's History record.

A hook (it runs before the experiment loggers, which then log its numbers). Per step it takes
two clock readings and, under DDP, the gradient reduction's exposed time from a timing
communication hook (``Strategy.timed_reductions``); per epoch one small all_reduce of every
rank's counts, so that the global numbers and the verdict are the same on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from nn_handler.errors import ConfigError
from nn_handler.monitoring.anatomy import StepTimes, verdict
from nn_handler.monitoring.flops import FlopCount, peak_tflops
from nn_handler.monitoring.memory import peak_memory_bytes, reset_peak_memory
from nn_handler.strategies.reduction_timer import ReductionTimer, timing_event
from nn_handler.training.batch import batch_size_of
from nn_handler.training.hooks import Hook

#: The History keys the monitor adds to each epoch's record.
RECORD_KEYS = (
    "samples_per_sec_rank",
    "tokens_per_sec",
    "tokens_per_sec_rank",
    "tflops",
    "mfu_pct",
    "step_ms",
    "data_wait_pct",
    "compute_pct",
    "exposed_comm_pct",
    "checkpoint_pct",
    "peak_mem_mb",
)


class ThroughputMonitor(Hook):
    """Throughput, FLOPs and the step anatomy of each epoch, in the History.

    Args:
        count_tokens: the tokens in one batch (``lambda batch: batch[0].numel()``); adds
            ``tokens_per_sec`` (all ranks) and ``tokens_per_sec_rank``.
        flops_per_sample: the training FLOPs of one sample (forward and backward); None:
            measured once, on the first step, with FlopCounterMode (not under compile).
        peak_tflops: the device's peak TFLOP/s for the MFU; None: looked up for known GPUs
            (``nn_handler.monitoring.PEAK_TFLOPS``), no MFU on CPU.
        time_reductions: time DDP's gradient reduction (the exposed part of a step) through
            a communication hook; False leaves DDP's built-in all-reduce in place.

    Keys added to each epoch record (``RECORD_KEYS``): samples_per_sec_rank (several ranks),
    tokens_per_sec (+ _rank, with count_tokens), tflops (achieved, this rank's device; with
    FLOPs known), mfu_pct (with a peak), step_ms (mean), data_wait_pct, compute_pct,
    exposed_comm_pct (when the reduction is timed), checkpoint_pct (with checkpoints): shares
    of the epoch's loop time on this rank; and peak_mem_mb. When data, communication or
    checkpoints take half of the step on some rank, the epoch's log line ends with a verdict
    naming it.
    """

    order = -10  # before the loggers: they log the record this hook completes

    def __init__(
        self,
        *,
        count_tokens: Callable[[Any], int] | None = None,
        flops_per_sample: float | None = None,
        peak_tflops: float | None = None,
        time_reductions: bool = True,
    ) -> None:
        if flops_per_sample is not None and flops_per_sample <= 0:
            raise ConfigError(f"flops_per_sample must be positive, got {flops_per_sample}.")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ConfigError(f"peak_tflops must be positive, got {peak_tflops}.")
        self.count_tokens = count_tokens
        self.flops_per_sample = flops_per_sample
        self.peak_tflops = peak_tflops
        self.time_reductions = time_reductions
        #: The last epoch's verdict (None when compute dominated), the same on every rank.
        self.last_verdict: str | None = None
        self._timer: ReductionTimer | None = None
        self._counting: FlopCount | None = None
        self._cuda = False
        self._count_flops = False
        self._more = False
        self._state: Any = None
        self._pending: dict[str, float] = {}
        self._reset(0.0)

    def _reset(self, now: float) -> None:
        self.times = StepTimes()
        # The per-step sums, plain attributes (the hot path; StepTimes is built per epoch).
        self._data = self._busy = self._comm = 0.0
        self._steps = self.samples = self.tokens = 0
        self._started = now
        self._last = now  # the end of the last step (or the start of the epoch)
        self._step_start = now
        self._events: list[tuple[Any, Any]] = []

    # ----------------------------------------------------------------- hook points
    def before_train(self) -> None:
        trainer = self.trainer
        self._state = trainer.state  # read per step: one lookup, not the trainer's weakref
        self._cuda = trainer.device.type == "cuda"
        # Asked each fit: the strategy registers its hook once per model wrapper it builds.
        self._timer = trainer.strategy.timed_reductions() if self.time_reductions else None
        if self.peak_tflops is None:
            self.peak_tflops = peak_tflops(trainer.device, trainer.precision.name)
        self._count_flops = self.flops_per_sample is None and self._can_count()

    def before_epoch(self) -> None:
        trainer = self.trainer
        reset_peak_memory(trainer.device)
        self._checkpoint_start = self._checkpoint_seconds()
        self._validation_start = trainer.state.validation_seconds
        if self._timer is not None:
            self._timer.take()  # nothing left from a step outside the loop
        # Whether a step needs more than its two clock readings and its sample count.
        self._more = bool(
            self._count_flops or self._cuda or self._timer or self.count_tokens is not None
        )
        self._reset(time.perf_counter())

    def before_step(self) -> None:
        now = time.perf_counter()
        self._data += now - self._last
        self._step_start = now
        if self._more:
            if self._count_flops and self._counting is None:
                self._counting = FlopCount().__enter__()
            if self._cuda:
                self._events.append((timing_event(), None))

    def after_step(self) -> None:
        now = time.perf_counter()
        self._busy += now - self._step_start
        self._steps += 1
        batch = self._state.batch
        self.samples += batch_size_of(batch)
        if self._more:
            self._after_step_more(batch)
        self._last = time.perf_counter() if self._more else now

    def _after_step_more(self, batch: Any) -> None:
        counting = self._counting
        if counting is not None and self._count_flops:
            counting.__exit__(None, None, None)
            self._counting = None  # closed once: a step of no FLOPs (an idle rank) leaves None
            self._count_flops = False
            self.flops_per_sample = counting.total / max(batch_size_of(batch), 1) or None
        if self._cuda:
            self._events[-1] = (self._events[-1][0], timing_event())
        if self._timer is not None:
            self._comm += self._timer.take()[0]
        if self.count_tokens is not None:
            self.tokens += int(self.count_tokens(batch))

    def after_train_epoch(self) -> None:
        """The epoch's numbers: every rank is here (its one all_reduce is safe), and the
        validation that follows is not part of the training loop's time."""
        trainer = self.trainer
        times = self.times
        times.steps, times.data, times.comm = float(self._steps), self._data, self._comm
        times.compute = max(self._busy - self._comm, 0.0)
        # To the end of the last step's checkpoint when one followed it: it is in
        # ``checkpoint``, so it is in the wall time too (shares of one whole).
        hook = trainer.checkpointing.hook
        ended = max(self._last, hook.step_ended if hook is not None else 0.0)
        times.wall = ended - self._started
        times.checkpoint = self._checkpoint_seconds() - self._checkpoint_start
        validation = trainer.state.validation_seconds - self._validation_start
        times.data = max(times.data - times.checkpoint - validation, 0.0)
        times.wall = max(times.wall - validation, 0.0)
        if self._cuda and self._events:
            self._events[-1][1].synchronize()
            gpu = sum(s.elapsed_time(e) for s, e in self._events if e is not None) / 1000.0
            times.compute = max(gpu - times.comm, 0.0)
        record = self._record(trainer)
        ranks = self._gather(trainer)
        shares = [rank.shares() for rank, _samples, _tokens in ranks]
        saving = trainer.checkpointing
        background = bool(saving.config.async_save and saving.writer.folder)
        self.last_verdict = verdict(shares, trainer.device.type == "cuda", background)
        if self.count_tokens is not None:  # every rank's tokens over the slowest rank's time
            wall = max(rank.wall for rank, _samples, _tokens in ranks)
            tokens = sum(tokens for _rank, _samples, tokens in ranks)
            record = {"tokens_per_sec": tokens / wall if wall > 0 else 0.0, **record}
        self._pending = record

    def after_epoch(self) -> None:
        """Completes the epoch's record (before the loggers log it) and the log line."""
        self.trainer.history.last.update(self._pending)
        self._pending = {}
        if self.last_verdict is not None:
            self.trainer.epoch_notes.append(self.last_verdict)

    def after_train(self) -> None:
        if self._counting is not None:
            self._counting.__exit__(None, None, None)  # training raised inside the first step
        self._counting = None

    # ----------------------------------------------------------------- parts
    def _record(self, trainer: Any) -> dict[str, float]:
        times, wall = self.times, self.times.wall
        rate = self.samples / wall if wall > 0 else 0.0
        several = trainer.comm.world_size > 1
        record = {"samples_per_sec_rank": rate} if several else {}
        if self.count_tokens is not None:
            record["tokens_per_sec_rank"] = self.tokens / wall if wall > 0 else 0.0
        if self.flops_per_sample:
            tflops = self.flops_per_sample * rate / 1e12
            record["tflops"] = tflops
            if self.peak_tflops:
                record["mfu_pct"] = 100.0 * tflops / self.peak_tflops
        shares = times.shares()
        record["step_ms"] = 1000.0 * wall / times.steps if times.steps else 0.0
        record["data_wait_pct"] = 100.0 * shares["data"]
        record["compute_pct"] = 100.0 * shares["compute"]
        if self._timer is not None:
            record["exposed_comm_pct"] = 100.0 * shares["comm"]
        if trainer.checkpointing.hook is not None:
            record["checkpoint_pct"] = 100.0 * shares["checkpoint"]
        record["peak_mem_mb"] = peak_memory_bytes(trainer.device) / 2**20
        return record

    def _gather(self, trainer: Any) -> list[tuple[StepTimes, float, float]]:
        """Every rank's (times, samples, tokens): one all_reduce of a table with a row per
        rank, each rank filling its own (none in one process)."""
        mine = [*self.times.as_list(), float(self.samples), float(self.tokens)]
        comm = trainer.comm
        if comm.world_size == 1:
            rows = [mine]
        else:
            table = torch.zeros(comm.world_size, len(mine), dtype=torch.float64)
            table[comm.rank] = torch.tensor(mine, dtype=torch.float64)
            rows = comm.all_reduce_(table.to(trainer.device), op="sum").tolist()
        width = len(self.times.as_list())
        return [(StepTimes.from_list(row[:width]), row[width], row[width + 1]) for row in rows]

    def _checkpoint_seconds(self) -> float:
        hook = self.trainer.checkpointing.hook
        return float(hook.step_seconds) if hook is not None else 0.0

    def _can_count(self) -> bool:
        return not self.trainer.config.compile


__all__ = ["RECORD_KEYS", "ThroughputMonitor"]
