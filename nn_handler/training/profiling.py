"""ProfilerHook: torch.profiler over a few training steps (``TrainerConfig.profile``).

One Chrome trace per rank and cycle in the configured folder, a table of the top operators
in rank 0's log, and on CUDA, on request, the allocator's memory snapshot (at the end of the
profiled steps and on an out-of-memory error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nn_handler.config.observability import ProfileConfig
from nn_handler.training.hooks import Hook


class ProfilerHook(Hook):
    """Profiles the batches ``config`` schedules (counted from the start of ``fit``).

    Attributes:
        traces: the Chrome traces this rank wrote.
        table: rank 0's table of the top operators of the last cycle ('' before one).
    """

    order = -20  # around the other hooks' work too

    def __init__(self, config: ProfileConfig) -> None:
        self.config = config
        self.traces: list[Path] = []
        self.table = ""
        self._profiler: Any = None
        self._cycles = 0
        self._snapshot: Path | None = None

    def before_train(self) -> None:
        config, trainer = self.config, self.trainer
        folder = Path(config.dir)
        folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if config.memory_snapshot:
                self._record_memory(folder / f"rank{trainer.comm.rank}.memory.pickle")
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                skip_first=config.skip_first,
                wait=config.wait,
                warmup=config.warmup,
                active=config.active,
                repeat=config.repeat,
            ),
            on_trace_ready=self._trace_ready,
            record_shapes=config.record_shapes,
            profile_memory=config.profile_memory,
            with_stack=config.with_stack,
        )
        self._profiler.start()

    def after_step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def after_train(self) -> None:
        self._stop()

    def _trace_ready(self, profiler: Any) -> None:
        trainer = self.trainer
        path = Path(self.config.dir) / (
            f"rank{trainer.comm.rank}.step{trainer.state.global_step}.trace.json"
        )
        profiler.export_chrome_trace(str(path))
        self.traces.append(path)
        self._cycles += 1
        if trainer.is_main_process:
            self.table = profiler.key_averages().table(
                sort_by=self.config.sort_by, row_limit=self.config.row_limit
            )
            trainer.log.info(
                "profiler: {} steps traced to {} (one trace per rank); top operators:\n{}",
                self.config.active,
                path,
                self.table,
            )
        if self._cycles >= self.config.repeat:
            self._dump_memory()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()
        self._dump_memory()

    # ----------------------------------------------------------------- CUDA memory
    def _record_memory(self, path: Path) -> None:
        self._snapshot = path
        torch.cuda.memory._record_memory_history(max_entries=100_000)

        def on_oom(*_args: Any) -> None:
            self._dump_memory()

        attach: Any = getattr(torch._C, "_cuda_attach_out_of_memory_observer")  # noqa: B009
        attach(on_oom)

    def _dump_memory(self) -> None:
        path, self._snapshot = self._snapshot, None
        if path is None:
            return
        dump: Any = torch.cuda.memory._dump_snapshot
        dump(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.trainer.log.info("CUDA memory snapshot written to {}", path)


__all__ = ["ProfilerHook"]
