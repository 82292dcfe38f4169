"""Stop every rank when one raises outside a collective agreement, instead of hanging.

(At the points where every rank meets, ranks agree on an error instead, in the same
collective: ``Communicator.raise_if_any_failed``, the one mechanism for "every rank raises
the same error"; this module is for everything else.)

When a rank fails in the middle of a training step, its peers are (or soon will be) blocked in
a collective it will never join. The failing rank publishes its traceback in the process
group's key-value store, then destroys its process group: the peers' pending collectives fail
at once (gloo closes the connections), they read the published traceback and raise
``RankFailedError`` with it. The failing rank waits (briefly) until the
peers have read it, because with ``mp.spawn``-style launches rank 0 hosts the store.

With nccl, peers blocked inside a CUDA kernel notice only at the process-group timeout (or when
torchrun's agent stops them, which it does as soon as the failing process exits).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from loguru import logger

from nn_handler.distributed.communicator import Communicator
from nn_handler.distributed.communicator._common import format_error
from nn_handler.distributed.context import collect_before_destroy
from nn_handler.distributed.faults.liveness import (
    default_store,
    departures_after,
    describe_exit,
    note_departure,
)
from nn_handler.distributed.faults.watchdog import WATCHDOGS
from nn_handler.errors import (
    CheckpointError,
    LauncherGoneError,
    NonFiniteError,
    RankFailedError,
    TrainingPreempted,
    UnevenDataError,
)

_PREFIX = "nn_handler/failure"
ACK_WAIT_S = 5.0


def _published(store: Any, world_size: int, kind: str, skip: int) -> list[int]:
    ranks = []
    for rank in range(world_size):
        if rank == skip:
            continue
        try:
            if store.check([f"{_PREFIX}/{kind}/{rank}"]):
                ranks.append(rank)
        except Exception:
            return ranks
    return ranks


def fail_together(
    error: BaseException,
    rank: int,
    world_size: int,
    what: str,
    release: Callable[[], None],
) -> BaseException:
    """The exception this rank should raise after ``error`` ended its step, having made sure
    every other rank stops too. Call it on every rank that caught an unexpected exception
    while the others may be in a collective; ``release`` drops objects (DDP wrappers) that
    must go before the group is destroyed. The process group is destroyed.

    Returns ``error`` itself on a rank that failed first, and a RankFailedError carrying the
    first failures' tracebacks on ranks whose collectives broke because a peer failed, or
    naming the peers that left the group (see liveness.py); the stall watchdog's report once
    it has made one (CollectiveStallError, CollectiveMismatchError). ``error`` may be a
    SystemExit or
    KeyboardInterrupt: this rank is then leaving, and says how.
    """
    if world_size == 1:
        return error
    store = default_store()
    if store is None:
        # Nowhere to publish the traceback, but the abort alone still unblocks the peers: their
        # collectives fail at once instead of waiting for the process-group timeout.
        logger.bind(rank=rank).warning(
            "rank {} failed in {} and the process group has no store to tell the other ranks "
            "why: aborting the group, so they stop with a connection error instead of the "
            "traceback",
            rank,
            what,
        )
        _abort(release)
        return error
    incident = WATCHDOGS.incident()
    if incident is not None and incident is not error:
        # The stall watchdog reported; this rank's collective broke because a peer raised it.
        _try(lambda: store.set(f"{_PREFIX}/ack/{rank}", "1"))
        _abort(release)
        return incident
    earlier = _published(store, world_size, "error", skip=rank)
    if not earlier and isinstance(error, Exception):
        gone = departures_after(error, world_size, rank)
        if gone:  # a peer left without publishing an error (killed, or store host gone)
            _abort(release)
            return RankFailedError(what, gone, note=f"rank {rank} stopped because of it.")
    if earlier:
        texts: dict[int, str] = {}
        for peer in earlier:
            try:
                texts[peer] = store.get(f"{_PREFIX}/error/{peer}").decode(errors="replace")
            except Exception:  # the store went away with the failed rank
                texts[peer] = "(its traceback could not be read)"
        _try(lambda: store.set(f"{_PREFIX}/ack/{rank}", "1"))
        _abort(release)
        # Brief: each failed rank prints its own traceback; the job's output holds it once.
        return RankFailedError(what, texts, note=f"rank {rank} stopped because of it.", brief=True)
    text = format_error(error)
    if not isinstance(error, Exception):
        text = f"{describe_exit(error)}\n{text}"
        note_departure(rank, describe_exit(error))
    _try(lambda: store.set(f"{_PREFIX}/error/{rank}", text))
    _abort(release)
    deadline = time.monotonic() + ACK_WAIT_S
    peers = world_size - 1
    while time.monotonic() < deadline:
        done = set(_published(store, world_size, "ack", rank))
        done |= set(_published(store, world_size, "error", rank))
        if len(done) >= peers:
            break
        time.sleep(0.05)
    return error


def _try(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception as caught:  # the store is best effort; the abort is what unblocks peers
        logger.debug("failure store unavailable: {}", caught)


def _abort(release: Callable[[], None]) -> None:
    release()
    collect_before_destroy()
    if dist.is_initialized():
        _try(dist.destroy_process_group)


#: Errors every rank raises together (after agreeing, or each finding it by itself: a
#: launcher gone), so the group needs no abort.
AGREED_ERRORS = (
    RankFailedError,
    NonFiniteError,
    CheckpointError,
    UnevenDataError,
    LauncherGoneError,
)


@contextlib.contextmanager
def failing_together(
    comm: Communicator, where: Callable[[], str], release: Callable[[], None]
) -> Iterator[None]:
    """Around a loop of collectives (the Trainer's fit): an error on this rank alone is told
    to every rank (which raise RankFailedError naming it, ``where()`` it happened) before it
    propagates; ``release`` drops the model's wrappers first. Agreed errors and an agreed
    preemption pass through unchanged.

    The job's output holds the failure once: the failed rank raises (and prints) its own
    error; the others raise a brief RankFailedError (one line per failed rank, the whole
    tracebacks in ``rank_messages``) or the stall report's headline, without the backend's
    connection errors chained in front."""
    try:
        yield
    except AGREED_ERRORS:
        raise
    except TrainingPreempted:  # every rank agreed to stop: nothing to propagate
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        if comm.world_size == 1:
            raise
        if not isinstance(error, Exception):  # this rank is leaving: say so, then leave
            fail_together(error, comm.rank, comm.world_size, "training", release)
            raise
        failure = fail_together(error, comm.rank, comm.world_size, where(), release)
        if failure is error:
            raise
        # This rank's own error is the backend's echo of the peer's failure (gloo's
        # "Connection closed by peer"): not printed in front of the report that explains it.
        logger.bind(rank=comm.rank).debug("rank {} stopped by: {!r}", comm.rank, error)
        raise failure from None


__all__ = ["ACK_WAIT_S", "AGREED_ERRORS", "fail_together", "failing_together"]
