"""The one checksum of checkpoints: CRC-32 (zlib's; it releases the GIL), of a whole file, a
span of a memory-mapped file, or a stream as it is read.

Every checksum a checkpoint's writer records or its reader checks is computed here, and
nowhere else (tests/unit/test_checkpoint_structure.py pins it), so that one place says how
many times each byte is checksummed: once when written, once when read or downloaded.
"""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path

#: The chunk a file or a download is read in.
CHUNK = 8 << 20


def _crc32(data: bytes | memoryview, crc: int = 0) -> int:
    """zlib's CRC-32 of ``data`` continuing ``crc``: the only call to it (tests count bytes
    through it)."""
    return zlib.crc32(data, crc)


class Crc32:
    """A CRC-32 computed as the bytes pass (a download, a write)."""

    def __init__(self) -> None:
        self._crc = 0
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        self._crc = _crc32(data, self._crc)
        self.size += len(data)

    @property
    def value(self) -> int:
        return self._crc & 0xFFFFFFFF


def crc32(data: bytes | memoryview) -> int:
    """The CRC-32 of ``data``."""
    return _crc32(data) & 0xFFFFFFFF


def span_crc32(view: memoryview, start: int, length: int) -> int:
    """The CRC-32 of ``length`` bytes of ``view`` from ``start``."""
    return _crc32(view[start : start + length]) & 0xFFFFFFFF


def file_crc32(path: Path) -> int:
    """The CRC-32 of a file's bytes, read in chunks."""
    crc = Crc32()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc.update(chunk)
    return crc.value


class mapped:
    """A read-only memoryview of a file (empty files cannot be memory-mapped)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def __enter__(self) -> memoryview:
        return self._view

    def __exit__(self, *exc: object) -> None:
        self._view.release()
        if self._map is not None:
            self._map.close()


__all__ = ["CHUNK", "Crc32", "crc32", "file_crc32", "mapped", "span_crc32"]
