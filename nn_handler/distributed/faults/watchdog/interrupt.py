"""Raising the watchdog's error on the training (main) thread from the watchdog's thread.

A rank that is alive but not in a collective (asleep in a hook, reading a file, looping) must
raise too. A Python signal handler on SIGUSR2 does it: ``pthread_kill`` wakes a sleeping or
blocked system call and the handler raises there. When the handler cannot be installed
(setup off the main thread, or SIGUSR2 already has the application's handler) the error is
set as the main thread's asynchronous exception instead, which Python raises at its next
bytecode (not inside a long sleep); the watchdog's last resort covers the rest.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from types import FrameType
from typing import Any

from loguru import logger

from nn_handler.distributed.faults.watchdog.ledger import CollectiveLedger

SIGNAL = getattr(signal, "SIGUSR2", None)


class MainThreadInterrupt:
    """Delivers ``ledger.incident`` to the training thread; ``install`` and ``uninstall`` on
    the main thread (elsewhere they do nothing and delivery falls back to an async exception,
    as it does when training runs on another thread)."""

    def __init__(self, ledger: CollectiveLedger) -> None:
        self._tracker = ledger
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if SIGNAL is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
            logger.debug("SIGUSR2 has the application's handler: stall errors arrive late")
            return
        self._previous = signal.signal(SIGNAL, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(SIGNAL) == self._on_signal:  # type: ignore[arg-type]
            signal.signal(SIGNAL, self._previous)  # type: ignore[arg-type]
        self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._tracker.incident is not None and not self._tracker.incident_raised:
            self._tracker.raise_incident()

    def deliver(self) -> None:
        """Make the training thread (the one that issued the latest collective; the main
        thread by default) raise the incident, once, wherever it is in Python code."""
        main = threading.main_thread().ident
        target = self._tracker.thread_ident or main
        if self._installed and SIGNAL is not None and target == main and main is not None:
            signal.pthread_kill(main, SIGNAL)
            return
        incident = self._tracker.incident
        if incident is None or target is None:
            return
        self._tracker.incident_raised = True
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(target), ctypes.py_object(_class_raising(incident))
        )


def _class_raising(incident: BaseException) -> type[BaseException]:
    """A subclass of ``type(incident)`` whose no-argument constructor rebuilds ``incident``
    (Python instantiates an asynchronous exception from its class)."""
    base = type(incident)

    def __init__(self: BaseException) -> None:
        self.__dict__.update(incident.__dict__)
        BaseException.__init__(self, *incident.args)

    def __reduce__(self: BaseException) -> Any:
        return incident.__reduce__()

    namespace = {"__init__": __init__, "__reduce__": __reduce__, "__module__": base.__module__}
    return type(base.__name__, (base,), namespace)


__all__ = ["MainThreadInterrupt"]
