"""Checksums of checkpoint files: every record torch.save writes carries its CRC-32.

``torch.save`` writes a zip archive and stores each record's CRC-32 in it (torch computes it
by default), but ``torch.load`` never checks them: a file whose tensor bytes were flipped on
disk loads without a word. ``verify_records`` recomputes them (zlib releases the GIL, so
it runs beside ``torch.load`` in a thread at little extra wall time) and names the first
record that does not match; ``entry_of_record`` turns that record back into the key path
of the tensor it holds.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.checksum import crc32, mapped, span_crc32

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, 30 bytes


@dataclass(frozen=True)
class BadRecord:
    """A record whose bytes do not match the CRC-32 stored for it."""

    name: str
    size: int
    stored: int
    actual: int

    def describe(self) -> str:
        kind = "the object structure" if self.name.endswith("data.pkl") else "tensor data"
        return (
            f"record {self.name!r} ({kind}, {self.size} bytes): CRC-32 {self.actual:08x}, "
            f"stored {self.stored:08x}"
        )


def verify_records(path: Path) -> BadRecord | None:
    """The first record of the torch zip file ``path`` whose bytes do not match its stored
    CRC-32, or None when all match (or the file has no checksums: a legacy, non-zip file or
    one saved with ``torch.serialization.set_crc32_options(False)``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return None  # not a zip: torch.load reports what is wrong with it
    if not records or all(r.CRC == 0 for r in records if r.file_size):
        return None
    with open(path, "rb") as handle, mapped(handle.fileno(), path.stat().st_size) as view:
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED:
                continue  # torch stores; anything else is not ours to check here
            start = _data_start(view, record.header_offset)
            if start is None or start + record.file_size > len(view):
                return BadRecord(record.filename, record.file_size, record.CRC, 0)
            actual = span_crc32(view, start, record.file_size)
            if actual != record.CRC:
                return BadRecord(record.filename, record.file_size, record.CRC, actual)
    return None


def record_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each record's (offset of its data in the file, size), by record name."""
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
    spans: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as handle, mapped(handle.fileno(), path.stat().st_size) as view:
        for record in records:
            start = _data_start(view, record.header_offset)
            if start is not None:
                spans[record.filename] = (start, record.file_size)
    return spans


def _data_start(view: memoryview, offset: int) -> int | None:
    if offset + _LOCAL_HEADER.size > len(view):
        return None
    fields = _LOCAL_HEADER.unpack_from(view, offset)
    if fields[0] != 0x04034B50:  # "PK\3\4"
        return None
    name_length, extra_length = fields[9], fields[10]
    return int(offset + _LOCAL_HEADER.size + name_length + extra_length)


def entry_of_record(obj: Any, bad: BadRecord) -> str | None:
    """The key path (``model.0.weight``) of the tensor in the loaded ``obj`` whose storage
    holds the bytes of ``bad`` (found by size and the CRC-32 of what was read), or None."""
    for key, tensor in _tensors(obj, ""):
        storage = tensor.untyped_storage()
        if storage.nbytes() != bad.size:
            continue
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage).cpu()
        if crc32(raw.numpy().tobytes()) == bad.actual:
            return key
    return None


def _tensors(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix or "(root)", obj)]
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            found += _tensors(value, f"{prefix}[{index}]")
    return found


__all__ = ["BadRecord", "entry_of_record", "record_spans", "verify_records"]
