"""The Communicator: one strategy object for every collective, on tensors and Python objects.

The public methods here validate and convert inputs (numbers, nested dicts/lists of tensors,
device moves, variable first dimensions, pickling) and then call five small hooks that a backend
implements: ``_do_barrier``, ``_do_all_reduce``, ``_do_broadcast``, ``_do_all_gather`` (equal
shapes) and ``_do_gather`` (equal shapes). Backends never see user data directly.

Every public method is a collective: every rank of the group must call it, in the same order,
or the group stalls until its timeout. Turn on debug mode (``debug=True`` or the environment
variable ``NN_HANDLER_DEBUG_COLLECTIVES=1`` on every rank) to turn such mistakes into a
``CollectiveMismatchError`` on every rank.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import torch

from nn_handler.distributed.communicator import _tree, _wire
from nn_handler.distributed.communicator._common import (
    debug_from_env,
    format_error,
    to_timedelta,
)
from nn_handler.distributed.communicator._watched import WatchedCollectives, collective
from nn_handler.distributed.communicator.object_collectives import ObjectCollectives
from nn_handler.distributed.faults.watchdog import CollectiveLedger
from nn_handler.errors import CollectiveMismatchError, ConfigError, RankFailedError

ReduceOp = Literal["sum", "mean", "min", "max", "product"]
BackendReduceOp = Literal["sum", "min", "max", "product"]
REDUCE_OPS: tuple[str, ...] = get_args(ReduceOp)

T = TypeVar("T")
Waiter = Callable[[], torch.Tensor]


class Communicator(ObjectCollectives, WatchedCollectives, ABC):
    """Collectives on tensors, numbers, nested containers of them, and picklable objects.

    Every public method must be called by every rank of the group, in the same order.
    In a group of one process every collective is an identity and costs no communication.
    """

    def __init__(self, *, debug: bool | None = None) -> None:
        self._debug = debug_from_env() if debug is None else bool(debug)
        #: The stall watchdog's record of this group's collectives (None: not watched).
        self._watch: CollectiveLedger | None = None

    # ----------------------------------------------------------------- identity of this rank
    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the communicator's group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the communicator's group."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device on which tensors travel (CUDA for nccl, CPU for gloo)."""

    @property
    def debug(self) -> bool:
        """Whether every collective is checked for matching calls across ranks first."""
        return self._debug

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, debug={self.debug})"
        )

    # ----------------------------------------------------------------- backend hooks
    @abstractmethod
    def _do_barrier(self, timeout: timedelta | None) -> None: ...

    @abstractmethod
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor: ...

    @abstractmethod
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None: ...

    # ----------------------------------------------------------------- tensor collectives
    @collective
    def barrier(self, timeout: float | timedelta | None = None) -> None:
        """Wait until every rank arrives. Every rank must call this.

        With ``timeout`` (seconds or timedelta) on gloo, a rank that does not arrive in time
        makes the call raise ``DistributedError`` naming the missing
        ranks; other backends wait up to the process group's timeout.
        """
        delta = to_timedelta(timeout)
        self._check_signature("barrier()")
        self._do_barrier(delta)

    @collective
    def all_reduce(self, data: T, op: ReduceOp = "sum") -> T:
        """Reduce ``data`` across ranks; every rank gets the result. Every rank must call this.

        ``data`` is a tensor, a Python number, or nested dicts/lists/tuples of them, with the
        same structure and shapes on every rank. ``op`` is sum, mean, min, max or product.
        Returns a new value of the same structure (inputs are not modified); tensors come back on
        their original device, numbers as Python numbers. Integer inputs average to float64;
        bool tensors reduce as int64.
        """
        checked = self._check_op(op)
        leaves, spec = self._prepare(data, f"all_reduce(op={checked})")
        values = self._reduce_leaves(leaves, "sum" if checked == "mean" else checked)
        if checked == "mean":
            values = [self._mean(v) for v in values]
        result: T = _tree.unflatten(spec, iter(values))
        return result

    @collective
    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place and return it. Every rank must call this.

        The copy-free variant of ``all_reduce`` for large buffers the caller owns (gradient
        buckets, metric accumulators): a contiguous tensor on the communicator's device is
        reduced in its own memory; any other tensor goes through one temporary copy. ``mean``
        needs a floating-point or complex tensor; bool tensors sum and average as int64, and the
        result is written back as bool (nonzero).
        """
        checked = self._check_in_place(tensor, op)
        mean = checked == "mean"
        self._check_signature(f"all_reduce_({tuple(tensor.shape)}, {tensor.dtype}, op={op})")
        target = tensor.detach()
        direct = (
            target.device == self.device and target.is_contiguous() and target.dtype != torch.bool
        )
        buffer = target
        if not direct:
            transport = _wire.reduce_transport(target.dtype)
            buffer = torch.empty(target.shape, dtype=transport, device=self.device)
            buffer.copy_(target)
        reduced = self._do_all_reduce(buffer, "sum" if mean else checked)  # type: ignore[arg-type]
        if reduced is not buffer:  # a backend may return a new tensor instead (its contract)
            buffer.copy_(reduced)
        if mean:
            buffer.div_(self.world_size)
        if buffer is not target:
            target.copy_(buffer)
        return tensor

    def _check_in_place(self, tensor: torch.Tensor, op: ReduceOp) -> ReduceOp:
        """``all_reduce_``'s arguments: a tensor, a known op, a mean only into floats."""
        self._require_tensor(tensor, "all_reduce_")
        checked = self._check_op(op)
        if checked == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ConfigError(
                f"all_reduce_(op='mean') cannot write a mean into a {tensor.dtype} tensor; pass "
                f"a floating-point tensor, or use all_reduce (it returns float64 means)."
            )
        return checked

    @collective
    def all_reduce_async(self, tensor: torch.Tensor, op: BackendReduceOp = "sum") -> Waiter:
        """Start reducing one tensor across ranks; returns a function that waits for and returns
        the result. Every rank must call this (and later the waiter) in the same order as its
        other collectives. Lets a caller overlap a small reduction with the next step's work;
        backends without asynchronous collectives reduce at once.
        """
        self._require_tensor(tensor, "all_reduce_async")
        checked = self._check_op(op)
        if checked == "mean":
            raise ConfigError("all_reduce_async supports sum, min, max and product, not mean.")
        self._check_signature(f"all_reduce_async({tuple(tensor.shape)}, {tensor.dtype})")
        source = tensor.detach()
        transport = _wire.reduce_transport(source.dtype)
        # A copy on the communicator's device (nccl reduces CUDA tensors only); the result
        # comes back on the input's device and dtype, as all_reduce's does.
        buffer = source.to(device=self.device, dtype=transport, copy=True)
        wait = self._do_all_reduce_async(buffer, op)
        if buffer.device == source.device and transport == source.dtype:
            return wait
        return lambda: wait().to(device=source.device, dtype=source.dtype)

    def _do_all_reduce_async(self, tensor: torch.Tensor, op: BackendReduceOp) -> Waiter:
        result = self._do_all_reduce(tensor, op)
        return lambda: result

    @collective
    def broadcast(self, data: T, src: int = 0) -> T:
        """Every rank gets rank ``src``'s ``data``. Every rank must call this.

        ``data`` is a tensor, a number or nested containers of them; receivers pass the same
        structure, shapes and dtypes (their values are ignored). Returns a new value.
        """
        self._check_rank("src", src)
        leaves, spec = self._prepare(data, f"broadcast(src={src})")
        values = _tree.packed_apply(
            leaves, self.device, _wire.copy_transport, lambda b: self._do_broadcast(b, src)
        )
        values = [v.to(leaf.dtype) for v, leaf in zip(values, leaves, strict=True)]
        result: T = _tree.unflatten(spec, iter(values))
        return result

    @collective
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank gets the list of all ranks' tensors, by rank. Every rank must call this.

        The first dimension may differ per rank (the result is exact: padding is removed);
        dtype and the other dimensions must match, or every rank raises
        ``CollectiveMismatchError`` listing each rank's shape.
        """
        self._require_tensor(tensor, "all_gather")
        self._check_signature("all_gather(tensor)")
        gathered = _wire.gather_variable(
            tensor.detach(), self.device, self._do_all_gather, None, "all_gather"
        )
        return gathered or []

    @collective
    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor]:
        """Rank ``dst`` gets the list of all ranks' tensors; other ranks get ``[]``.

        Every rank must call this. First dimensions may differ per rank, as in
        ``all_gather``.
        """
        self._require_tensor(tensor, "gather")
        self._check_rank("dst", dst)
        self._check_signature(f"gather(tensor, dst={dst})")
        gather = functools.partial(self._do_gather, dst=dst)
        gathered = _wire.gather_variable(
            tensor.detach(), self.device, self._do_all_gather, gather, "gather"
        )
        return gathered or []

    def gather_into_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """All ranks' tensors concatenated along dimension 0 (stacked for 0-d tensors), on every
        rank. Every rank must call this. First dimensions may differ per rank."""
        parts = self.all_gather(tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    # ----------------------------------------------------------------- agreement and helpers
    @collective
    def raise_if_any_failed(
        self, error: BaseException | None, what: str, share: Sequence[int] = ()
    ) -> list[list[int]]:
        """Agree across ranks on whether a step succeeded. Every rank must call this.

        Pass the exception this rank caught (or None). If any rank passes one, every rank raises
        ``RankFailedError`` naming each failed rank's error and line in one line (``brief``:
        the failing rank's own error is its ``__cause__``, printed with it, so a job's output
        holds each traceback once; ``rank_messages`` has them all). In one process the
        original exception is re-raised unchanged. ``share``: a few integers (as many on every rank)
        that travel with the agreement at no extra round trip; returns every rank's, in rank
        order, when no rank failed.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return [list(share)]
        self._check_signature(f"raise_if_any_failed(share of {len(share)})")
        flag = torch.tensor([int(error is not None), *share], dtype=torch.int64, device=self.device)
        rows = [[int(v) for v in row.tolist()] for row in self._do_all_gather(flag)]
        flags = [row[0] for row in rows]
        if not any(flags):
            return [row[1:] for row in rows]
        text = format_error(error) if error is not None else ""
        texts = self._all_gather_bytes(text.encode())
        failed = {r: t.decode(errors="replace") for r, t in enumerate(texts) if flags[r]}
        raise RankFailedError(what, failed, brief=True) from error

    @collective
    def reduce_dict(
        self, input_dict: Mapping[str, Any], average: bool = True, *, ignore_nan: bool = False
    ) -> dict[str, Any]:
        """Sum (or average over ranks) a dict of numbers/tensors; every rank gets the result.

        Every rank must call this with the same keys (in any order; the result's are sorted)
        and shapes: different ones raise
        ``CollectiveMismatchError`` on every rank, listing each rank's dict (one tiny extra
        all_reduce checks it), never a silently mixed result. By default, as detectron2's
        ``reduce_dict``, a NaN or inf on any rank propagates into the result, so a finiteness
        check of a reduced loss sees a diverging rank.

        ``ignore_nan=True`` is the reduction for metrics that some ranks cannot compute: per key
        and element, ranks whose value is NaN contribute a zero sum and a zero count; the result
        is the sum of the others (``average=False``) or that sum divided by how many ranks were
        not NaN. When every rank is NaN the result is NaN. Infinities are ordinary values.
        Tensors come back as tensors on their device, numbers as numbers; integers stay
        integers in a sum (``average=False``, as detectron2's), a mean is floating.
        """
        if not isinstance(input_dict, Mapping):
            raise ConfigError(
                f"reduce_dict expects a dict of numbers or tensors, got "
                f"{type(input_dict).__name__}."
            )
        # Keys in sorted order, as detectron2's: the same dict built in another order agrees.
        ordered = dict(sorted(input_dict.items(), key=lambda item: str(item[0])))
        what = f"reduce_dict(average={average}, ignore_nan={ignore_nan})"
        leaves, spec = self._prepare(ordered, what)
        self._agree_on_structure(f"{what} {_tree.describe(spec)}")
        if not ignore_nan:  # integers stay integers in a sum, as detectron2's
            sent = [
                leaf if leaf.is_floating_point() or not average else leaf.to(torch.float64)
                for leaf in leaves
            ]
            totals = self._reduce_leaves(sent, "sum")
            plain: dict[str, Any] = _tree.unflatten(
                spec, iter(self._mean(t) if average else t for t in totals)
            )
            return plain
        totals = self._reduce_leaves(_wire.nan_sums_and_counts(leaves), "sum")
        results = _wire.nan_ignoring_results(totals, average)
        reduced: dict[str, Any] = _tree.unflatten(spec, iter(results))
        return reduced

    @collective
    def shared_random_seed(self) -> int:
        """A random int in [0, 2**31) that is the same on every rank (rank 0's draw from
        numpy's global generator, so seeded runs repeat). Every rank must call this."""
        seed = int(np.random.randint(2**31))
        self._check_signature("shared_random_seed()")
        tensor = torch.tensor([seed], dtype=torch.int64, device=self.device)
        return int(self._do_broadcast(tensor, 0).item())

    # ----------------------------------------------------------------- internals
    def _check_op(self, op: str) -> ReduceOp:
        if op not in REDUCE_OPS:
            raise ConfigError(f"op={op!r} is not a reduction; use one of {list(REDUCE_OPS)}.")
        return op  # type: ignore[return-value]

    def _check_rank(self, name: str, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int rank, got {value!r}.")
        if not 0 <= value < self.world_size:
            raise ConfigError(
                f"{name}={value} is not a rank of this group (0..{self.world_size - 1})."
            )

    @staticmethod
    def _require_tensor(value: Any, what: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"{what} takes a torch.Tensor, got {type(value).__name__}; use "
                f"{what}_object for other Python objects."
            )

    def _prepare(self, data: Any, what: str) -> tuple[list[torch.Tensor], _tree.Spec]:
        """Flatten ``data``; in debug mode first agree with the other ranks on the call."""
        try:
            leaves, spec = _tree.flatten(data)
        except ConfigError as error:
            self._check_signature(f"{what} with invalid input ({error})")
            raise
        self._check_signature(f"{what} {_tree.describe(spec)}")
        return leaves, spec

    def _check_signature(self, signature: str) -> None:
        """Record the collective for the stall watchdog; in debug mode also raise
        CollectiveMismatchError on every rank unless all signatures match."""
        if self._watch is not None:
            self._watch.enter(signature)
        if not self._debug:
            return
        digest = torch.tensor([_wire.signature_hash(signature)], dtype=torch.int64)
        digests = {int(d.item()) for d in self._do_all_gather(digest.to(self.device))}
        if len(digests) == 1:
            return
        signatures = [s.decode() for s in self._all_gather_bytes(signature.encode())]
        raise CollectiveMismatchError(
            "collective debug check",
            signatures,
            hint="Every rank must call the same collectives, in the same order, with the same "
            "structure, dtypes and shapes.",
        )

    def _agree_on_structure(self, signature: str) -> None:
        """Raise CollectiveMismatchError on every rank unless every rank's ``signature`` (keys,
        dtypes, shapes) is the same: one max-reduce of [hash, -hash], equal only when all are.
        (Debug mode already compared the signatures.)"""
        if self._debug:
            return
        digest = _wire.signature_hash(signature)
        pair = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        largest, negated_smallest = self._do_all_reduce(pair, "max").tolist()
        if largest == -negated_smallest:
            return
        signatures = [s.decode() for s in self._all_gather_bytes(signature.encode())]
        raise CollectiveMismatchError(
            signature.split(" ", 1)[0],
            signatures,
            hint="Every rank must pass the same keys, with the same dtypes and shapes.",
        )

    def _reduce_leaves(self, leaves: list[torch.Tensor], op: BackendReduceOp) -> list[torch.Tensor]:
        return _tree.packed_apply(
            leaves, self.device, _wire.reduce_transport, lambda b: self._do_all_reduce(b, op)
        )

    def _mean(self, total: torch.Tensor) -> torch.Tensor:
        if total.is_floating_point() or total.is_complex():
            return total / self.world_size
        return total.to(torch.float64) / self.world_size

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's byte string (texts for error reports), padded to the longest."""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        lengths = [int(n.item()) for n in self._do_all_gather(length)]
        parts = self._do_all_gather(_wire.bytes_to_tensor(payload, max(lengths), self.device))
        return [_wire.tensor_to_bytes(p, n) for p, n in zip(parts, lengths, strict=True)]
