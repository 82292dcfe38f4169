"""What a HandlerConfig's ``logging`` section asks for: the log sinks a handler adds while it
lives (stderr, a file per rank) and the observing hooks (the throughput and learning-rate
monitors, the experiment trackers)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from loguru import logger

from nn_handler.config import LoggingConfig
from nn_handler.log import disable_logging, enable_logging, name_the_process
from nn_handler.monitoring import LearningRateMonitor, ThroughputMonitor
from nn_handler.tracking import build_trackers
from nn_handler.training.hooks import Hook


def add_log_sinks(config: LoggingConfig, rank: int, label: str | None = None) -> list[int]:
    """The stderr sink (and the file sink, if asked); ``label``: this process's name in their
    lines while the handler lives (a fault-tolerant member's, instead of 'rank 0')."""
    if not config.enabled:
        return []
    sinks = [enable_logging(config.level, all_ranks=config.all_ranks, label=label)]
    if config.file is not None and ("{rank}" in config.file or rank == 0):
        path = Path(config.file.format(rank=rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        sinks.append(
            logger.add(
                path,
                level=config.level,
                filter=lambda record: (
                    record["name"] is not None
                    and record["name"].startswith("nn_handler")
                    and name_the_process(record)
                ),
                format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {extra[who]} | {level: <7} | {message}",
            )
        )
    return sinks


def remove_log_sinks(sinks: list[int]) -> None:
    """Undo ``add_log_sinks``: the file sink, then the stderr one (which may silence the
    library and give loguru's default sink back)."""
    for sink in reversed(sinks[1:]):
        logger.remove(sink)
    if sinks:
        disable_logging(sinks[0])


def observers(config: LoggingConfig, given: Iterable[Hook]) -> list[Hook]:
    """The hooks ``logging`` asks for: a ThroughputMonitor (unless ``monitor`` is off or
    ``given`` has one), a LearningRateMonitor (``log_lr: step``) and the trackers of
    ``trackers``."""
    added: list[Hook] = []
    if config.monitor and not any(isinstance(hook, ThroughputMonitor) for hook in given):
        added.append(
            ThroughputMonitor(
                flops_per_sample=config.flops_per_sample, peak_tflops=config.peak_tflops
            )
        )
    if config.log_lr == "step" and not any(isinstance(h, LearningRateMonitor) for h in given):
        added.append(LearningRateMonitor())
    added.extend(build_trackers(config.trackers, config.dir))
    return added


__all__ = ["add_log_sinks", "observers", "remove_log_sinks"]
