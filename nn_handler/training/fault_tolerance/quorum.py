"""A member's request for a quorum (torchft's) that outlives its Lighthouse: asked once the
Lighthouse answers, and asked again of a restarted one (torchft's request would wait out its
timeout: the new Lighthouse never heard of it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from nn_handler.errors import NNHandlerError
from nn_handler.training.fault_tolerance import engine
from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts


def start_quorum(
    manager: Any,
    verdicts: ReconnectingVerdicts,
    ask: Callable[[Callable[[], Any]], Any],
    timeout_s: float,
) -> None:
    """One quorum of ``manager``, asked once the Lighthouse answers (``ask``: a request to
    ``verdicts``, with its error when none does); asked again once if the Lighthouse was
    restarted while it waited. Raises the quorum's last error (ours, a state it cannot take,
    at once)."""
    for _ in range(2):
        reconnects = verdicts.reconnects
        ask(lambda: verdicts.check([]))
        asked = threading.Event()
        again = threading.Thread(
            target=_ask_again, args=(manager, verdicts, timeout_s, asked), daemon=True
        )
        again.start()
        try:
            manager.start_quorum()
            return
        except NNHandlerError:
            raise
        except Exception as error:  # torchft's quorum timed out or its server failed
            failure = error
        finally:
            asked.set()
        engine.drop_failed_quorum(manager)
        ask(lambda: verdicts.check([]))
        if verdicts.reconnects == reconnects:
            break  # the same Lighthouse all along: its answer stands
    raise failure


def _ask_again(
    manager: Any, verdicts: ReconnectingVerdicts, timeout_s: float, answered: threading.Event
) -> None:
    """While the request for a quorum is in flight (until ``answered``): once its Lighthouse
    was restarted (the member reconnected), send the request again (engine.ask_quorum_again)
    until one reaches the new Lighthouse (it blocks until the quorum: the one in flight is
    answered with it) instead of waiting out the first's ``timeout_s``. Looks every quarter
    second (one request to the store)."""
    seen = verdicts.reconnects
    again = timedelta(seconds=timeout_s)
    while not answered.wait(0.25):
        with contextlib.suppress(NNHandlerError, RuntimeError, OSError):
            verdicts.check([])  # reconnects if the Lighthouse is a new one
        if verdicts.reconnects == seen or answered.is_set():
            continue
        try:
            engine.ask_quorum_again(manager, again)
            return  # answered: the quorum in flight too
        except Exception:  # the new Lighthouse not reached yet: again
            continue


__all__ = ["start_quorum"]
