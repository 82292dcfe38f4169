"""Rank-gated execution that never hangs: on_rank and main_process_first (seed 002).

Both take part in one small collective after the gated code, in which the ranks agree on
whether it succeeded: an exception on any rank becomes a
``RankFailedError`` on every rank within milliseconds, and the group
stays aligned for the next collective. Like any collective this waits at most the process
group's timeout for ranks that are still running the gated code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from nn_handler.distributed.functional import communicator, get_local_rank
from nn_handler.errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")


def _ranks(rank: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(rank, int):
        values: tuple[object, ...] = (rank,)
    elif isinstance(rank, Sequence) and not isinstance(rank, str):
        values = tuple(rank)
    else:
        values = ()
    if not values or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in values):
        raise ConfigError(f"on_rank takes a rank or a non-empty list of ranks >= 0, got {rank!r}.")
    return tuple(sorted({int(r) for r in values}))  # type: ignore[call-overload]


def on_rank(
    rank: int | Sequence[int], barrier: bool = False, broadcast: bool = False
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Run the decorated function only on ``rank`` (an int or a list of ranks).

    Every rank must call the decorated function. It returns the function's value on the ranks
    that ran it and None on the others; with ``broadcast=True`` (exactly one rank) every rank
    gets the value. If the function raises on any running rank, every rank raises
    ``RankFailedError`` naming the function, the failing rank(s) and
    the original error with its traceback (chained as ``__cause__`` on the failing rank).
    ``barrier=True`` adds a barrier after a successful call. In one process the function is
    called (or skipped) and its exceptions propagate unchanged.
    """
    ranks = _ranks(rank)
    if broadcast and len(ranks) != 1:
        raise ConfigError(f"on_rank(broadcast=True) needs exactly one rank, got {list(ranks)}.")

    def decorate(fn: Callable[P, R]) -> Callable[P, R | None]:
        label = f"@on_rank({ranks[0] if len(ranks) == 1 else list(ranks)}) {fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            comm = communicator()
            if comm.world_size == 1:
                return fn(*args, **kwargs) if 0 in ranks else None
            if ranks[-1] >= comm.world_size:
                raise ConfigError(
                    f"{label}: rank {ranks[-1]} does not exist in a world of {comm.world_size}."
                )
            result: R | None = None
            error: BaseException | None = None
            if comm.rank in ranks:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as caught:  # every kind must reach the other ranks
                    error = caught
            with comm.patient():  # the other ranks wait while these run ``fn``
                comm.raise_if_any_failed(error, label)
            if broadcast:
                result = comm.broadcast_object(result, src=ranks[0])
            if barrier:
                comm.barrier()
            return result

        return wrapper

    return decorate


@contextmanager
def main_process_first(local: bool = False) -> Iterator[None]:
    """Run the body on the main process first, then on the others (e.g. download, then read).

    The main process is global rank 0, or local rank 0 on every machine with ``local=True``.
    Every rank must enter it. If the body fails on the main process, the waiting ranks raise
    ``RankFailedError`` instead of running it or hanging; if it fails on
    another rank, every rank raises, the main process included. In one process the body simply
    runs.
    """
    comm = communicator()
    if comm.world_size == 1:
        yield
        return
    is_main = (get_local_rank() if local else comm.rank) == 0
    first = "main_process_first: the body on the main process"
    then = "main_process_first: the body on the other processes"
    # Each side waits while the other runs the body (a download, a preprocessing pass): the
    # waits are longer than any collective's, so the stall watchdog lets them be.
    if is_main:
        try:
            yield
        except BaseException as error:
            with comm.patient():
                comm.raise_if_any_failed(error, first)
            raise  # pragma: no cover - raise_if_any_failed always raises here
        with comm.patient():
            comm.raise_if_any_failed(None, first)
            comm.raise_if_any_failed(None, then)
    else:
        with comm.patient():
            comm.raise_if_any_failed(None, first)
        try:
            yield
        except BaseException as error:
            with comm.patient():
                comm.raise_if_any_failed(error, then)
            raise  # pragma: no cover
        with comm.patient():
            comm.raise_if_any_failed(None, then)


__all__ = ["main_process_first", "on_rank"]
