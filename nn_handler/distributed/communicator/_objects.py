"""Python objects as byte frames for the object collectives, with tensors and arrays out of band.

Plain pickling copies a CPU tensor through ``torch.save`` into a new byte string (about 90 µs
for a small one) and every large buffer is copied again on each side. Here objects pickle with
protocol 5: contiguous NumPy arrays and plain CPU tensors travel as out-of-band buffers, written
once into the send buffer and rebuilt on the receiver as views of the received bytes (no copy).

A frame is ``[n_buffers, stream_len, buffer_len...]`` (int64), the pickle stream, then each
buffer at a 64-byte aligned offset, so rebuilt tensors are aligned like fresh allocations.
"""

from __future__ import annotations

import io
import pickle
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN = 64
_INT = np.dtype("<i8")
_DTYPES = {str(dtype): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.bool,
)}  # fmt: skip


def align(length: int) -> int:
    """``length`` rounded up to a multiple of ``ALIGN``."""
    return -(-length // ALIGN) * ALIGN


def _rebuild_tensor(data: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data`` (an out-of-band buffer: received bytes, not copied)."""
    if not shape or all(shape):  # at least one element
        flat = torch.frombuffer(data, dtype=torch.uint8)
        return flat.view(_DTYPES[dtype]).view(shape)
    return torch.empty(shape, dtype=_DTYPES[dtype])


def _fast_tensor(obj: Any) -> bool:
    """Plain, dense CPU tensors without autograd history take the out-of-band route; anything
    else (CUDA, sparse, subclasses such as Parameter, requires_grad) pickles as torch does."""
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and str(obj.dtype) in _DTYPES
        and not obj.is_conj()
        and not obj.is_neg()
    )


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _fast_tensor(obj):
            data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            return _rebuild_tensor, (
                pickle.PickleBuffer(data.data),
                str(obj.dtype),
                tuple(obj.shape),
            )
        return NotImplemented


@dataclass
class Frame:
    """A pickled object ready to copy into a send buffer of ``length`` bytes."""

    stream: bytes
    buffers: list[memoryview]

    @property
    def header(self) -> np.ndarray:
        lengths = [len(self.stream), *(b.nbytes for b in self.buffers)]
        return np.array([len(self.buffers), *lengths], dtype=_INT)

    @property
    def length(self) -> int:
        end = align(self.header.nbytes + len(self.stream))
        for buffer in self.buffers:
            end = align(end + buffer.nbytes)
        return end

    def write_into(self, out: np.ndarray) -> None:
        """Copy the frame into the uint8 array ``out`` (at least ``length`` bytes)."""
        header = self.header.view(np.uint8)
        out[: header.size] = header
        start = header.size
        out[start : start + len(self.stream)] = np.frombuffer(self.stream, dtype=np.uint8)
        end = align(start + len(self.stream))
        for buffer in self.buffers:
            out[end : end + buffer.nbytes] = np.frombuffer(buffer, dtype=np.uint8)
            end = align(end + buffer.nbytes)


def dumps(obj: Any) -> tuple[Frame, BaseException | None]:
    """``obj`` as a frame (cloudpickle for lambdas and local classes). On failure the frame holds
    the error's text as its stream, and the error is returned too."""
    buffers: list[memoryview] = []

    def keep(buffer: pickle.PickleBuffer) -> None:
        buffers.append(buffer.raw())

    sink = io.BytesIO()
    try:
        _Pickler(sink, protocol=5, buffer_callback=keep).dump(obj)
        return Frame(sink.getvalue(), buffers), None
    except Exception as first:
        buffers.clear()
        try:
            import cloudpickle

            return Frame(cloudpickle.dumps(obj, protocol=5, buffer_callback=keep), buffers), None
        except Exception:
            text = "".join(traceback.format_exception_only(type(first), first)).strip()
            return Frame(text.encode(), []), first


def read_stream(part: np.ndarray) -> bytes:
    """The pickle stream of a frame (on a failed rank: its error text)."""
    count = int(part[:8].view(_INT)[0])
    length = int(part[8:16].view(_INT)[0])
    start = 8 * (2 + count)
    return part[start : start + length].tobytes()


def loads(part: np.ndarray) -> Any:
    """The object in the frame at the start of the uint8 array ``part``. Arrays and tensors in
    it are views of ``part``'s memory. Unpickling trusts the sender (a member of the group)."""
    count = int(part[:8].view(_INT)[0])
    lengths = part[8 : 8 * (2 + count)].view(_INT).tolist()
    start = 8 * (2 + count)
    stream = part[start : start + lengths[0]].data
    end = align(start + lengths[0])
    buffers = []
    for length in lengths[1:]:
        buffers.append(part[end : end + length].data)
        end = align(end + length)
    return pickle.loads(stream, buffers=buffers)
