"""The records of a torch.save zip file: where each one's bytes are, and the CRC-32 torch
stored for it in the zip directory (written last: a single file's manifest). torch.load never
checks them; the verifier does (checkpoint/verify.py ``verify_records``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

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


def data_start(view: memoryview, offset: int) -> int | None:
    if offset + _LOCAL_HEADER.size > len(view):
        return None
    fields = _LOCAL_HEADER.unpack_from(view, offset)
    if fields[0] != 0x04034B50:  # "PK\3\4"
        return None
    name_length, extra_length = fields[9], fields[10]
    return int(offset + _LOCAL_HEADER.size + name_length + extra_length)


def tensors_of(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix or "(root)", obj)]
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += tensors_of(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            found += tensors_of(value, f"{prefix}[{index}]")
    return found


__all__ = ["BadRecord", "data_start", "tensors_of"]
