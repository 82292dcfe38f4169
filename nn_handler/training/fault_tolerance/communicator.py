"""ReplicaCommunicator: the collectives of one step among its members, over the torchft group
of a Replica (ranks are the members' ranks in the current step). A member lost during a
collective makes it raise PeerLostError, and every later one of that step too: the step is
abandoned, not committed, and redone by the members left (Replica.commit)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from typing_extensions import override

from nn_handler.distributed.communicator.base import BackendReduceOp, Communicator
from nn_handler.errors import DistributedError, PeerLostError
from nn_handler.training.fault_tolerance.engine import AllgatherOptions

_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


class Member(Protocol):
    """What the collectives need of a member (a Replica has it)."""

    member_id: str
    timeout_s: float
    group: Any  # torchft's reconfigurable process group
    failure: BaseException | None

    @property
    def step(self) -> int: ...

    @property
    def rank(self) -> int | None: ...

    @property
    def members(self) -> int: ...

    def wait(self, work: Any) -> None: ...

    def lost(self, error: BaseException) -> None: ...

    def abandoned(self, what: str, error: BaseException) -> str: ...


class ReplicaCommunicator(Communicator):
    """Collectives among the current step's members of ``replica``, on CPU tensors."""

    def __init__(self, replica: Member) -> None:
        super().__init__(debug=False)
        self._replica = replica

    @property
    @override
    def rank(self) -> int:
        rank = self._replica.rank
        if rank is None:
            raise DistributedError(
                f"member {self._replica.member_id} takes no part in step {self._replica.step}."
            )
        return rank

    @property
    @override
    def world_size(self) -> int:
        return self._replica.members

    @property
    @override
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _run(self, what: str, start: Callable[[], Any]) -> None:
        replica = self._replica
        if replica.failure is not None:
            raise PeerLostError(replica.abandoned(what, replica.failure))
        try:
            replica.wait(start())
        except Exception as error:
            replica.lost(error)
            raise PeerLostError(replica.abandoned(what, error)) from error

    @override
    def _do_barrier(self, timeout: timedelta | None) -> None:
        self._do_all_reduce(torch.zeros(1), "sum")

    @override
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = _OPS[op]
        self._run("all_reduce", lambda: self._replica.group.allreduce([tensor], options))
        return tensor

    @override
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self._run("broadcast", lambda: self._replica.group.broadcast([tensor], options))
        return tensor

    @override
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        flat = tensor.contiguous()
        options = AllgatherOptions()
        self._run("all_gather", lambda: self._replica.group.allgather([parts], [flat], options))
        return parts

    @override
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        parts = self._do_all_gather(tensor)
        return parts if self.rank == dst else None


__all__ = ["ReplicaCommunicator"]
