"""Rank-aware logging through loguru.

The library logs under the name "nn_handler" and calls ``logger.disable("nn_handler")`` on
import, adding no sinks. Applications (NNHandler by default, the CLI) call
``enable_logging`` and undo it with ``disable_logging``.

One line per event: while nn_handler's sink is on, loguru's own default stderr sink (handler 0,
which would print every record again, on every rank) is lent to it: the sink prints the
application's records as that default did (every rank, its level) and nn_handler's on rank 0
only. ``disable_logging`` of the last sink gives the default back. A sink the application
added itself is never touched.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from loguru import logger
from tqdm import tqdm

if TYPE_CHECKING:
    from loguru import Message, Record

_LIBRARY = "nn_handler"
_FORMAT = "<green>{time:HH:mm:ss}</green> | {extra[who]} | <level>{level: <7}</level> | {message}"
# loguru adds its default stderr sink with this id at import (unless LOGURU_AUTOINIT=0).
_LOGURU_DEFAULT_SINK = 0


_SinkKey = tuple[int, bool]  # (level number, all_ranks)


class _StderrLease:
    """Which of our sinks are on, who holds them, and whether loguru's default sink was lent
    to them. Callers asking for the same sink share one (two NNHandlers alive at once still
    print each event once).

    Mirrors loguru's own process-wide handler table; the only state this module keeps."""

    def __init__(self) -> None:
        self.sinks: dict[
            _SinkKey, tuple[int, int]
        ] = {}  # key -> (loguru id, holders), oldest first
        self.handles: dict[int, _SinkKey] = {}  # what enable_logging returned -> its sink
        self.next_handle = 1
        self.lock = threading.Lock()  # handlers may live in threads (run_in_threads)
        self.default_taken = False
        self.default_id = _LOGURU_DEFAULT_SINK  # the default sink's id (a new one once given back)
        #: The names holders gave this process (a fault-tolerant member's), by handle.
        self.labels: dict[int, str] = {}

    def take_default(self) -> bool:
        if self.default_taken:
            return True
        try:
            logger.remove(self.default_id)
        except ValueError:
            return False  # the application removed or replaced it: leave its sinks alone
        self.default_taken = True
        return True

    def give_back(self) -> None:
        if self.default_taken:
            self.default_taken = False
            # loguru's defaults (LOGURU_FORMAT, LOGURU_LEVEL) apply; written to the sys.stderr of
            # the moment, as ours are, never to a stream captured and closed since.
            self.default_id = logger.add(_to_stderr, colorize=is_terminal(sys.stderr))


_LEASE = _StderrLease()


def _rank() -> int:
    from nn_handler.distributed.functional import get_rank

    try:
        return get_rank()
    except Exception:
        return 0


def process_name(rank: int) -> str:
    """How nn_handler's lines name this process: ``rank N``, or the name a holder of a sink
    gave it (``member m1``: each member of a fault-tolerant run is rank 0 of its own)."""
    labels = _LEASE.labels
    return next(reversed(labels.values())) if labels else f"rank {rank}"


def name_the_process(record: Record) -> bool:
    """A loguru filter that puts ``process_name`` in ``record['extra']['who']`` (for a
    format's ``{extra[who]}``) and lets every record through."""
    extra = record["extra"]
    extra.setdefault("rank", _rank())
    extra["who"] = process_name(extra["rank"])
    return True


def _is_library(record: Record) -> bool:
    name = record["name"]
    return name is not None and (name == _LIBRARY or name.startswith(_LIBRARY + "."))


def _write(message: Message) -> None:
    # Through tqdm, so a line logged while a progress bar is shown lands above the bar.
    tqdm.write(str(message), file=sys.stderr, end="")


def _to_stderr(message: Message) -> None:
    sys.stderr.write(str(message))


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is an open terminal (False for pipes, files, closed streams)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


def enable_logging(level: str = "INFO", all_ranks: bool = False, label: str | None = None) -> int:
    """Print nn_handler's logs on stderr, tagged with the rank (or ``label``, this process's
    name while the handle is held: ``member m1``); rank 0 only unless ``all_ranks``. Returns
    a handle: pass it to ``disable_logging`` to undo.

    While loguru's default stderr sink is in place it is lent to this sink, so no record is
    printed twice; the application's own records still print on every rank, as before. Calls
    with the same arguments share one sink."""
    key: _SinkKey = (logger.level(level).no, all_ranks)
    with _LEASE.lock:
        handle = _enable(key)
        if label is not None:
            _LEASE.labels[handle] = label
        return handle


def _enable(key: _SinkKey) -> int:
    all_ranks = key[1]
    handle = _LEASE.next_handle
    _LEASE.next_handle += 1
    _LEASE.handles[handle] = key
    if key in _LEASE.sinks:
        sink, holders = _LEASE.sinks[key]
        _LEASE.sinks[key] = (sink, holders + 1)
        return handle
    _LEASE.take_default()

    def accept(record: Record) -> bool:
        name_the_process(record)
        if _is_library(record):
            shown_here = all_ranks or record["extra"]["rank"] == 0
            return shown_here and record["level"].no >= key[0]
        # The application's records, as loguru's default sink showed them: by one sink only.
        return _LEASE.default_taken and next(iter(_LEASE.sinks), None) == key

    logger.enable(_LIBRARY)
    colorize = is_terminal(sys.stderr)
    sink = logger.add(_write, level=0, filter=accept, format=_FORMAT, colorize=colorize)
    _LEASE.sinks[key] = (sink, 1)
    return handle


def disable_logging(handle: int) -> None:
    """Undo one ``enable_logging`` (by the handle it returned). When no holder of a sink is
    left the sink goes; when no sink is left nn_handler is silent again and loguru's default
    stderr sink, if it was lent, is back. Idempotent."""
    with _LEASE.lock:
        _disable(handle)


def _disable(handle: int) -> None:
    _LEASE.labels.pop(handle, None)
    key = _LEASE.handles.pop(handle, None)
    if key is None:
        return
    sink, holders = _LEASE.sinks[key]
    if holders > 1:
        _LEASE.sinks[key] = (sink, holders - 1)
        return
    del _LEASE.sinks[key]
    logger.remove(sink)
    if not _LEASE.sinks:
        logger.disable(_LIBRARY)
        _LEASE.give_back()


__all__ = [
    "disable_logging",
    "enable_logging",
    "is_terminal",
    "name_the_process",
    "process_name",
]
