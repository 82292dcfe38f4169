"""VerifiedTransport: how a joining member receives the whole state from a live one, over the
step's process group: the state as torch.save bytes with their size and CRC-32 (the entry a
checkpoint's manifest records), checked as they arrive and loaded ``weights_only``. It
replaces torchft's PGTransport, which unpickles what it receives (a peer's bytes could run
code) and checks nothing."""

from __future__ import annotations

import io
import re
from datetime import timedelta
from typing import IO, Any, cast

import torch

from nn_handler.checkpoint.verify import entry_of_bytes
from nn_handler.errors import CheckpointError
from nn_handler.training.fault_tolerance.engine import CheckpointTransport

#: The message tags: the header (size, CRC-32, step), then the bytes.
_HEADER, _BYTES = 101, 102
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class VerifiedTransport(CheckpointTransport):  # type: ignore[misc]
    """Sends and receives a member's state over ``group`` (torchft's reconfigurable group,
    whose ranks are the members' ranks in the current step)."""

    def __init__(self, group: Any, timeout: timedelta) -> None:
        self._group = group
        self._timeout = timeout

    def metadata(self) -> str:
        return "nn_handler.verified"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getbuffer()  # the bytes once: the payload is a view of them
        entry = entry_of_bytes(data)
        header = torch.tensor([entry["size"], entry["crc32"], step], dtype=torch.int64)
        payload = torch.frombuffer(data, dtype=torch.uint8)
        works = []
        for rank in dst_ranks:
            works.append(self._group.send([header], rank, tag=_HEADER))
            works.append(self._group.send([payload], rank, tag=_BYTES))
        for work in works:
            work.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        where = f"the state sent by member {src_rank} at step {step}"
        header = torch.zeros(3, dtype=torch.int64)
        self._group.recv([header], src_rank, tag=_HEADER).wait(timeout)
        size, crc, sent_step = (int(v) for v in header.tolist())
        if sent_step != step:
            raise CheckpointError(f"{where}: it is of step {sent_step}; it was refused.")
        payload = torch.empty(size, dtype=torch.uint8)
        self._group.recv([payload], src_rank, tag=_BYTES).wait(timeout)
        data = payload.numpy().data  # read where they arrived: no copy
        got = entry_of_bytes(data)
        if got["crc32"] != crc:
            raise CheckpointError(
                f"{where} is corrupt: its {size} bytes have CRC-32 {got['crc32']:08x}, "
                f"{crc:08x} was sent; it was refused (it is sent again at the next step)."
            )
        try:
            reader = cast("IO[bytes]", _Reader(data))
            return torch.load(reader, map_location="cpu", weights_only=True)
        except Exception as error:  # a refused global, a foreign stream
            named = _GLOBAL.search(str(error))
            why = f"it names {named[1]}" if named else f"{type(error).__name__}"
            raise CheckpointError(
                f"{where} cannot be loaded weights-only ({why}); it was refused."
            ) from error


class _Reader(io.RawIOBase):
    """A seekable reader of bytes already in memory, without a copy of them (BytesIO copies
    any but a ``bytes`` object)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._at = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), len(self._data) - self._at)
        memoryview(buffer).cast("B")[:size] = self._data[self._at : self._at + size]
        self._at += size
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


__all__ = ["VerifiedTransport"]
