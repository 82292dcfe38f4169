"""Rank-aware logging through loguru.

The library logs under the name "nn_handler" and calls ``logger.disable("nn_handler")`` on
import, adding no sinks; applications (the CLI included) call :func:`enable_logging`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from loguru import logger

if TYPE_CHECKING:
    from loguru import Record


def _rank() -> int:
    from nn_handler.distributed.functional import get_rank

    try:
        return get_rank()
    except Exception:
        return 0


def enable_logging(level: str = "INFO", all_ranks: bool = False) -> int:
    """Enable nn_handler's logs on stderr, tagged with the rank; rank 0 only unless
    ``all_ranks``. Returns the loguru sink id (``logger.remove(id)`` to undo)."""

    def on_this_rank(record: Record) -> bool:
        record["extra"].setdefault("rank", _rank())
        return all_ranks or record["extra"]["rank"] == 0

    logger.enable("nn_handler")
    return logger.add(
        sys.stderr,
        level=level,
        filter=on_this_rank,
        format="<green>{time:HH:mm:ss}</green> | rank {extra[rank]} | <level>{level: <7}</level>"
        " | {message}",
    )


__all__ = ["enable_logging"]
