"""The object collectives of every Communicator: ``all_gather_object``, ``gather_object`` and
``broadcast_object``, built on the backend's tensor hooks (communicator/base.py).

Objects are pickled into frames (communicator/_objects.py: CPU tensors and NumPy arrays travel
as raw bytes); a pickling failure on any rank is agreed in the size exchange and raises
RankFailedError naming that rank on every rank; receivers agree after unpickling, so nobody
hangs and the group stays usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nn_handler.distributed.communicator import _objects
from nn_handler.distributed.communicator._watched import collective
from nn_handler.distributed.faults.watchdog import CollectiveLedger
from nn_handler.errors import RankFailedError

#: Object payloads above this size move one rank at a time (bounded memory).
_LARGE_FRAME = 16 * 2**20
#: all_gather_object's first round: a fixed 16 KiB buffer that carries the lengths and, when
#: every rank's frame fits, the frames themselves (a 64-byte header keeps them aligned).
_EAGER_BYTES = 16384
_EAGER_HEADER = 64


class ObjectCollectives:
    """Collectives on picklable objects; every rank of the group must call each, in order."""

    _watch: CollectiveLedger | None

    if TYPE_CHECKING:  # the Communicator's (communicator/base.py)

        @property
        def rank(self) -> int: ...

        @property
        def device(self) -> torch.device: ...

        def _do_barrier(self, timeout: timedelta | None) -> None: ...

        def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

        def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

        def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None: ...

        def _check_signature(self, signature: str) -> None: ...

        def _check_rank(self, name: str, value: int) -> None: ...

        def raise_if_any_failed(
            self, error: BaseException | None, what: str, share: Sequence[int] = ()
        ) -> list[list[int]]: ...

    @collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank gets the list of all ranks' picklable objects. Every rank must call this.

        Each rank pickles first; an object that cannot be pickled on some rank raises
        ``RankFailedError`` naming that rank on every rank (agreed in
        the size exchange, at no extra round trip), and the group stays usable. CPU tensors and
        NumPy arrays inside objects travel as raw bytes and arrive as views of the received
        buffer (tensors as contiguous tensors of the same dtype and shape; views of one storage
        arrive as separate tensors). Payloads above 16 MiB move one rank at a time, so a rank
        holds at most one peer's payload besides the results. Unpickling trusts the group's
        members.
        """
        self._check_signature("all_gather_object(obj)")
        frame, error = _objects.dumps(obj)
        lengths, failed_flags, small = self._exchange_small(frame, error)
        if small is not None:  # every frame came with the lengths: one round trip
            if any(failed_flags):
                failed = self._failures(small, failed_flags)
                raise RankFailedError(
                    "all_gather_object: pickling the object", failed, brief=True
                ) from error
            return self._unpickle_together(small, "all_gather_object")
        large = max(lengths) > _LARGE_FRAME and not any(failed_flags)
        send = self._send_buffer(frame, lengths[self.rank] if large else max(lengths))
        del frame  # the send buffer holds the only copy now
        if not large:
            parts = [part.cpu().numpy() for part in self._do_all_gather(send)]
            if any(failed_flags):
                failed = self._failures(parts, failed_flags)
                raise RankFailedError(
                    "all_gather_object: pickling the object", failed, brief=True
                ) from error
            return self._unpickle_together(parts, "all_gather_object")
        # One rank at a time: each payload is unpickled and its buffer dropped before the next.
        frames = self._broadcast_frames(send, lengths)
        del send
        return self._unpickle_together(frames, "all_gather_object")

    @collective
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        """Rank ``dst`` gets the list of all ranks' objects; other ranks get ``[]``.

        Every rank must call this. Pickling failures raise on every rank and tensors travel as
        in ``all_gather_object``.
        """
        self._check_rank("dst", dst)
        self._check_signature(f"gather_object(obj, dst={dst})")
        frame, error = _objects.dumps(obj)
        lengths, failed_flags = self._exchange_lengths(frame.length, error)
        if any(failed_flags):
            parts = self._all_gather_frames(frame, lengths)
            failed = self._failures(parts, failed_flags)
            raise RankFailedError(
                "gather_object: pickling the object", failed, brief=True
            ) from error
        gathered = self._do_gather(self._send_buffer(frame, max(lengths)), dst)
        parts = [] if gathered is None else [part.cpu().numpy() for part in gathered]
        return self._unpickle_together(parts, "gather_object")

    @collective
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Every rank gets rank ``src``'s picklable object (``obj`` is ignored elsewhere).

        Every rank must call this. If ``src`` cannot pickle it, every rank raises
        ``RankFailedError`` naming ``src``.
        """
        self._check_rank("src", src)
        self._check_signature(f"broadcast_object(obj, src={src})")
        frame, error = _objects.dumps(obj) if self.rank == src else (_objects.Frame(b"", []), None)
        status = torch.tensor([int(error is not None), frame.length], dtype=torch.int64)
        failed_flag, length = self._do_broadcast(status.to(self.device), src).tolist()
        send = self._send_buffer(frame, length) if self.rank == src else None
        buffer = send if send is not None else torch.empty(length, dtype=torch.uint8)
        part = self._do_broadcast(buffer.to(self.device), src).cpu().numpy()
        if failed_flag:
            message = {src: _objects.read_stream(part).decode(errors="replace")}
            raise RankFailedError(
                "broadcast_object: pickling the object", message, brief=True
            ) from error
        if self.rank == src:
            self.raise_if_any_failed(None, "broadcast_object: unpickling the object")
            return obj
        return self._unpickle_together([part], "broadcast_object")[0]

    # ----------------------------------------------------------------- transport
    def _exchange_small(
        self, frame: _objects.Frame, error: BaseException | None
    ) -> tuple[list[int], list[int], list[np.ndarray] | None]:
        """Every rank's frame length and pickling-failure flag, in one all-gather of a fixed
        buffer that also carries each frame small enough to fit (a list of floats, a dict of
        metrics: the common case). Returns the frames too when every one fitted, else None
        (the caller then sends them in a second round)."""
        buffer = torch.zeros(_EAGER_BYTES, dtype=torch.uint8)
        out = buffer.numpy()
        out[:16].view(np.int64)[:] = [int(error is not None), frame.length]
        if frame.length <= _EAGER_BYTES - _EAGER_HEADER:
            frame.write_into(out[_EAGER_HEADER:])
        parts = [part.cpu().numpy() for part in self._do_all_gather(buffer.to(self.device))]
        statuses = [part[:16].view(np.int64).tolist() for part in parts]
        lengths = [int(length) for _, length in statuses]
        flags = [int(flag) for flag, _ in statuses]
        if max(lengths) <= _EAGER_BYTES - _EAGER_HEADER:
            return lengths, flags, [part[_EAGER_HEADER:] for part in parts]
        return lengths, flags, None

    def _exchange_lengths(
        self, length: int, error: BaseException | None
    ) -> tuple[list[int], list[int]]:
        """Every rank's frame length and pickling-failure flag, in one all-gather."""
        status = torch.tensor([int(error is not None), length], dtype=torch.int64)
        statuses = [s.tolist() for s in self._do_all_gather(status.to(self.device))]
        return [length for _, length in statuses], [flag for flag, _ in statuses]

    def _send_buffer(self, frame: _objects.Frame, length: int) -> torch.Tensor:
        """``frame`` in a uint8 tensor of ``length`` bytes on the communicator's device."""
        buffer = torch.empty(length, dtype=torch.uint8)
        frame.write_into(buffer.numpy())
        buffer[frame.length :] = 0
        return buffer.to(self.device)

    def _all_gather_frames(self, frame: _objects.Frame, lengths: list[int]) -> list[np.ndarray]:
        """Every rank's frame, in one all-gather padded to the longest."""
        parts = self._do_all_gather(self._send_buffer(frame, max(lengths)))
        return [part.cpu().numpy() for part in parts]

    def _broadcast_frames(self, send: torch.Tensor, lengths: list[int]) -> Iterator[np.ndarray]:
        """Every rank's frame (this rank's in ``send``), one broadcast per rank, each sized to
        its own length; a part is yielded before the next is allocated, so the caller can
        unpickle it and drop it first."""
        own: torch.Tensor | None = send
        del send
        for src, length in enumerate(lengths):
            if src == self.rank and own is not None:
                buffer, own = own, None
            else:
                buffer = torch.empty(length, dtype=torch.uint8, device=self.device)
            yield self._do_broadcast(buffer, src).cpu().numpy()
            del buffer

    def _unpickle_together(self, parts: Iterable[np.ndarray], what: str) -> list[Any]:
        """Unpickle ``parts`` (possibly none), then agree with every rank on whether that
        worked: an object that pickles on its sender but fails to unpickle on a receiver
        raises RankFailedError on every rank, naming the receiver (one tiny all_gather)."""
        objects: list[Any] = []
        error: BaseException | None = None
        for part in parts:  # every part is received, also after a failure (collectives)
            if error is None:
                try:
                    objects.append(_objects.loads(part))
                except Exception as caught:
                    error = caught
        self.raise_if_any_failed(error, f"{what}: unpickling the object")
        return objects

    @staticmethod
    def _failures(parts: list[np.ndarray], flags: list[int]) -> dict[int, str]:
        return {
            rank: _objects.read_stream(part).decode(errors="replace")
            for rank, (part, flag) in enumerate(zip(parts, flags, strict=True))
            if flag
        }


__all__ = ["ObjectCollectives"]
