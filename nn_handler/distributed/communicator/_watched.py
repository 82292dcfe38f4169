"""The ``collective`` decorator: the stall watchdog's view of a Communicator's public calls."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from nn_handler.distributed.watchdog import WATCHDOGS, CollectiveTracker
from nn_handler.errors import (
    CollectiveMismatchError,
    CollectiveStallError,
    ConfigError,
    RankFailedError,
)


class Watched(Protocol):
    _watch: CollectiveTracker | None


P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=Watched)


def collective(method: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
    """Mark a public collective: the stall watchdog sees it end; a backend error caused by a
    reported stall or mismatch (a peer raised and left the group) becomes that report, and
    one caused by peers that vanished a RankFailedError naming them."""

    @functools.wraps(method)
    def watched(self: C, /, *args: P.args, **kwargs: P.kwargs) -> R:
        watch = self._watch
        if watch is None:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except (CollectiveStallError, CollectiveMismatchError, RankFailedError, ConfigError):
            raise
        except Exception as error:
            incident = watch.incident if watch.incident is not None else WATCHDOGS.incident()
            if incident is None:
                vanished = WATCHDOGS.vanished(error)
                if vanished is None:
                    raise
                raise vanished from error
            watch.incident_raised = True
            raise incident from error
        finally:
            watch.leave()

    return watched


__all__ = ["collective"]
