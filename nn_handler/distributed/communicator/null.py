"""NullCommunicator: the single-process backend. Every collective is an identity.

The base class's generic paths work for a group of one through the hooks below; the public
methods overridden here are the single-process semantics and fast paths: a tensor's
all_reduce is one copy, object collectives hand back the object itself (nothing is pickled),
tensor gathers one copy, reduce_dict keeps each value's type.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch
from typing_extensions import override

from nn_handler.distributed.communicator import _wire
from nn_handler.distributed.communicator.base import (
    BackendReduceOp,
    Communicator,
    ReduceOp,
)

T = TypeVar("T")


class NullCommunicator(Communicator):
    """A group of one process: rank 0, world size 1; needs no torch.distributed at all."""

    def __init__(self, device: torch.device | str = "cpu", *, debug: bool | None = None) -> None:
        super().__init__(debug=debug)
        self._device = torch.device(device)

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    # ----------------------------------------------------------------- one-process semantics
    @override
    def all_reduce(self, data: T, op: ReduceOp = "sum") -> T:
        if not isinstance(data, torch.Tensor):
            return super().all_reduce(data, op)
        checked = self._check_op(op)
        # A copy in the reduction's dtype; no flattening, no communication.
        single = data.detach().to(_wire.reduce_transport(data.dtype), copy=True)
        result = self._mean(single) if checked == "mean" else single  # integers average to f64
        return result  # type: ignore[return-value]

    @override
    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """One tensor's sum, min, max, product and mean is itself: nothing is copied (the
        base class would copy a tensor on another device than this communicator's)."""
        self._check_in_place(tensor, op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._require_tensor(tensor, "all_gather")
        return [tensor.detach().clone()]

    @override
    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor]:
        self._require_tensor(tensor, "gather")
        self._check_rank("dst", dst)
        return [tensor.detach().clone()]

    @override
    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    @override
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        self._check_rank("dst", dst)
        return [obj]

    @override
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._check_rank("src", src)
        return obj

    @override
    def reduce_dict(
        self, input_dict: Mapping[str, Any], average: bool = True, *, ignore_nan: bool = False
    ) -> dict[str, Any]:
        if isinstance(input_dict, Mapping):
            ordered = dict(sorted(input_dict.items(), key=lambda item: str(item[0])))
            single = _reduce_dict_one_process(ordered, average)
            if single is not None:
                return single
        return super().reduce_dict(input_dict, average, ignore_nan=ignore_nan)

    @override
    def _reduce_leaves(self, leaves: list[torch.Tensor], op: BackendReduceOp) -> list[torch.Tensor]:
        # Numbers and nested containers: each leaf copied in its reduction dtype, unpacked.
        return [leaf.to(_wire.reduce_transport(leaf.dtype), copy=True) for leaf in leaves]

    # ----------------------------------------------------------------- backend hooks
    @override
    def _do_barrier(self, timeout: timedelta | None) -> None:
        return None

    @override
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor:
        return tensor

    @override
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    @override
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    @override
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        return [tensor]


def _reduce_dict_one_process(input_dict: Mapping[str, Any], average: bool) -> dict[str, Any] | None:
    """reduce_dict's result in a group of one (NaN stays NaN; integers stay integers in a
    sum), or None for nested input."""
    result: dict[str, Any] = {}
    for key, value in input_dict.items():
        if isinstance(value, torch.Tensor):
            keep = value.is_floating_point() or not average
            dtype = _wire.reduce_transport(value.dtype) if keep else torch.float64
            result[key] = value.detach().to(dtype, copy=True)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            result[key] = value if isinstance(value, int) and not average else float(value)
        else:
            return None
    return result
