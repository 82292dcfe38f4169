"""ThreadCommunicator: N ranks as N threads of one process, for tests of your own code.

Also the worked example of a Communicator backend: a backend implements the five ``_do_*``
hooks below on tensors of ``device`` and nothing else (validation, packing, object pickling,
debug checks and NaN rules are the base class's). Their contracts:

- ``_do_all_reduce(tensor, op)``: every rank's ``tensor`` combined with ``op`` ('sum', 'min',
  'max', 'product'); return the result, either ``tensor`` reduced in place or a new tensor (the
  caller uses what is returned).
- ``_do_broadcast(tensor, src)``: rank ``src``'s tensor; receivers pass one of the same shape
  and dtype. Return the result (in place or new).
- ``_do_all_gather(tensor)``: the list of every rank's tensor, by rank (equal shapes).
- ``_do_gather(tensor, dst)``: that list on rank ``dst``; None on the others.
- ``_do_barrier(timeout)``: return once every rank has called it (``timeout`` may be ignored).

Every rank calls the hooks in the same order; a hook never sees a group of one unless the
communicator's world size is 1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from typing_extensions import override

from nn_handler.distributed.communicator.base import BackendReduceOp, Communicator
from nn_handler.errors import RankFailedError

_COMBINE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda stacked: stacked.sum(0),
    "min": lambda stacked: stacked.min(0).values,
    "max": lambda stacked: stacked.max(0).values,
    "product": lambda stacked: stacked.prod(0),
}


class ThreadGroup:
    """The meeting point of N ThreadCommunicators: each collective is one ``exchange``.

    A barrier with generations: ``abort`` breaks the rounds not yet complete (their waiters
    raise BrokenBarrierError) but never a round every rank already reached, which
    ``threading.Barrier.abort`` can do to a waiter that has not woken up yet."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._slots: list[Any] = [None] * world_size
        self._condition = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank, on every rank."""
        self._slots[rank] = value
        self._wait()
        values = list(self._slots)
        self._wait()  # nobody writes the next round before everyone has read this one
        return values

    def _wait(self) -> None:
        with self._condition:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.world_size:
                self._arrived = 0
                self._generation += 1
                self._condition.notify_all()
                return
            deadline = time.monotonic() + self.timeout_s
            while generation == self._generation and not self._broken:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._broken = True  # a rank never came: every waiter raises
                    self._condition.notify_all()
                    break
                self._condition.wait(remaining)
            if generation == self._generation:  # the round did not complete
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        """Release every rank waiting in an incomplete exchange (they raise)."""
        with self._condition:
            self._broken = True
            self._condition.notify_all()


class ThreadCommunicator(Communicator):
    """Rank ``rank`` of a ThreadGroup: every collective of the Communicator, for real, between
    threads. Tensors travel as copies; ``device`` is where results are placed."""

    def __init__(
        self,
        group: ThreadGroup,
        rank: int,
        device: torch.device | str = "cpu",
        *,
        debug: bool | None = None,
    ) -> None:
        super().__init__(debug=debug)
        self.group = group
        self._rank = rank
        self._device = torch.device(device)

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def world_size(self) -> int:
        return self.group.world_size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @override
    def _do_barrier(self, timeout: timedelta | None) -> None:
        self.group.exchange(self._rank, None)

    @override
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor:
        parts = self.group.exchange(self._rank, tensor.detach().clone())
        # A new tensor (the caller uses the result), in the input's dtype: torch's sum and
        # prod would promote integers to int64.
        combined: torch.Tensor = _COMBINE[op](torch.stack(parts))
        return combined.to(tensor.dtype)

    @override
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        parts: list[torch.Tensor] = self.group.exchange(self._rank, tensor.detach().clone())
        return parts[src].clone()

    @override
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = self.group.exchange(self._rank, tensor.detach().clone())
        return [part.clone() for part in parts]

    @override
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        parts = self.group.exchange(self._rank, tensor.detach().clone())
        return [part.clone() for part in parts] if self._rank == dst else None


def run_in_threads(
    fn: Callable[[Communicator], Any], world_size: int, *, timeout_s: float = 60.0
) -> list[Any]:
    """Run ``fn(communicator)`` on ``world_size`` threads, one ThreadCommunicator each, and
    return the results by rank. A rank that raises releases the others (they raise too) and
    the call raises RankFailedError naming each failed rank; a collective that waits more than
    ``timeout_s`` for a rank fails with BrokenBarrierError on every rank."""
    group = ThreadGroup(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    first: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadCommunicator(group, rank))
        except BaseException as error:
            errors[rank] = f"{type(error).__name__}: {error}"
            first.append(error)
            group.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RankFailedError("run_in_threads", errors) from first[0]
    return results


__all__ = ["ThreadCommunicator", "ThreadGroup", "run_in_threads"]
