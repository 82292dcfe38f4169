"""The stall watchdog's view of a Communicator: the ``collective`` decorator on its public calls,
and the ``watched`` / ``patient`` sections every Communicator offers."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from nn_handler.distributed.faults.watchdog import WATCHDOGS, CollectiveLedger
from nn_handler.errors import (
    CollectiveMismatchError,
    CollectiveStallError,
    ConfigError,
    LauncherGoneError,
    RankFailedError,
)


class Watched(Protocol):
    _watch: CollectiveLedger | None


P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=Watched)


def _orphaned(watch: CollectiveLedger) -> LauncherGoneError | None:
    """This worker's LauncherGoneError if its launcher is gone (looked at again now)."""
    if watch.launcher_check is not None:
        watch.launcher_check()
    return watch.incident if isinstance(watch.incident, LauncherGoneError) else None


def collective(method: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
    """Mark a public collective: the stall watchdog sees it end; a backend error caused by a
    reported stall or mismatch (a peer raised and left the group) becomes that report, and
    one caused by peers that vanished a RankFailedError naming them, unless this worker's
    launcher is gone: then the peers left as orphans too (torchrun's agent killed while this
    rank was already inside the collective), and the error is this rank's LauncherGoneError."""

    @functools.wraps(method)
    def watched(self: C, /, *args: P.args, **kwargs: P.kwargs) -> R:
        watch = self._watch
        if watch is None:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except (CollectiveStallError, CollectiveMismatchError, ConfigError):
            raise
        except Exception as error:
            orphan = _orphaned(watch)
            if orphan is not None:
                watch.incident_raised = True
                raise orphan from None
            if isinstance(error, RankFailedError):
                raise
            incident = watch.incident if watch.incident is not None else WATCHDOGS.incident()
            if incident is None:
                vanished = WATCHDOGS.vanished(error)
                if vanished is None:
                    raise
                raise vanished from error
            watch.incident_raised = True
            if isinstance(incident, LauncherGoneError):  # the peer left for the same reason
                raise incident from None
            raise incident from error
        finally:
            watch.leave()

    return watched


class WatchedCollectives:
    """The stall watchdog's sections, mixed into Communicator (``_watch`` is set by the
    Communicator: the default group's ledger, or None when nothing watches)."""

    _watch: CollectiveLedger | None

    @property
    def watching(self) -> bool:
        """Whether the stall watchdog records this communicator's collectives."""
        return self._watch is not None

    def watched(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Count code that issues collectives this communicator does not see (DDP's gradient
        reduction in backward, FSDP's gathers) as one collective named ``what``, so the stall
        watchdog can report a rank waiting there. Every rank must enter it, in the same order
        as its other collectives."""
        if self._watch is None:
            return contextlib.nullcontext()
        return self._watch.region(what)

    @contextlib.contextmanager
    def patient(self) -> Iterator[None]:
        """Collectives inside may legitimately wait longer than the stall timeout (rank 0
        prepares data or writes a checkpoint while the others wait); the process-group timeout
        still bounds them. Enter it on every rank."""
        if self._watch is None:
            yield
            return
        with self._watch.patient():
            yield


__all__ = ["WatchedCollectives", "collective"]
