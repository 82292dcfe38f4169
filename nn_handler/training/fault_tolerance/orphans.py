"""Child processes that end with the process that started them: the Lighthouse a
``Lighthouse`` starts, the members ``nn-handler supervise`` starts. A parent killed with
SIGKILL runs no cleanup; on Linux the kernel then sends each such child a signal
(``PR_SET_PDEATHSIG``), so that none runs on re-parented to PID 1."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def ending_with_this_process(sent: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sent`` when the thread
    that started it ends (its process killed, or a thread of its own that returns: start
    such children from a thread that lives as long as they should). None off Linux, where
    the child outlives a killed parent."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sent), 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sent)

    return arm


__all__ = ["ending_with_this_process"]
