"""What travels on the wire besides user tensors: bytes and tensor metadata as int64 tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from nn_handler.errors import CollectiveMismatchError

#: Every dtype a tensor collective can carry; the index is the code sent to other ranks.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
MAX_DIMS = 16
META_SIZE = 2 + MAX_DIMS


def encode_meta(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[dtype code, ndim, dims... padded with -1] as an int64 tensor of fixed length."""
    meta = torch.full((META_SIZE,), -1, dtype=torch.int64)
    meta[0] = _CODES.get(tensor.dtype, -1)
    meta[1] = tensor.dim()
    dims = list(tensor.shape)[:MAX_DIMS]
    if dims:
        meta[2 : 2 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    return meta.to(device)


def decode_meta(meta: torch.Tensor) -> tuple[torch.dtype | None, tuple[int, ...]]:
    values = meta.tolist()
    code, ndim = int(values[0]), int(values[1])
    dtype = DTYPES[code] if 0 <= code < len(DTYPES) else None
    return dtype, tuple(int(d) for d in values[2 : 2 + min(ndim, MAX_DIMS)])


def describe_meta(dtype: torch.dtype | None, shape: tuple[int, ...]) -> str:
    name = str(dtype).replace("torch.", "") if dtype is not None else "unsupported dtype"
    return f"{name}{list(shape)}"


def bytes_to_tensor(payload: bytes, length: int, device: torch.device) -> torch.Tensor:
    """``payload`` as a uint8 tensor padded with zeros to ``length``."""
    buffer = torch.zeros(length, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(device)


def tensor_to_bytes(tensor: torch.Tensor, length: int) -> bytes:
    return tensor[:length].cpu().numpy().tobytes()


def signature_hash(signature: str) -> int:
    """A stable 63-bit hash of a collective's signature text (equal on every rank and run)."""
    digest = hashlib.blake2b(signature.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def reduce_transport(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.bool else dtype


def copy_transport(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def check_gatherable(
    decoded: list[tuple[torch.dtype | None, tuple[int, ...]]], what: str
) -> list[tuple[int, ...]]:
    first_dtype, first_shape = decoded[0]
    consistent = all(
        dtype is not None
        and dtype == first_dtype
        and len(shape) == len(first_shape)
        and shape[1:] == first_shape[1:]
        and len(shape) <= MAX_DIMS
        for dtype, shape in decoded
    )
    if not consistent:
        raise CollectiveMismatchError(
            what,
            [describe_meta(dtype, shape) for dtype, shape in decoded],
            hint="Tensors may differ in their first dimension only; dtype, number of "
            f"dimensions (at most {MAX_DIMS}) and the other dimensions must match.",
        )
    return [shape for _, shape in decoded]


def gather_variable(
    tensor: torch.Tensor,
    device: torch.device,
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
    gather: Callable[[torch.Tensor], list[torch.Tensor] | None] | None,
    what: str,
) -> list[torch.Tensor] | None:
    """Gather tensors whose first dimension may differ: exchange shapes, pad, gather (to every
    rank with ``gather`` None), trim. ``all_gather`` and ``gather`` are a backend's equal-shape
    hooks."""
    metas = all_gather(encode_meta(tensor, device))
    decoded = [decode_meta(meta) for meta in metas]
    shapes = check_gatherable(decoded, what)
    dtype = copy_transport(tensor.dtype)
    buffer = tensor.to(device=device, dtype=dtype)
    if tensor.dim() > 0:
        longest = max(shape[0] for shape in shapes)
        if tensor.shape[0] < longest:
            pad = buffer.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            buffer = torch.cat([buffer, pad])
    buffer = buffer.contiguous()
    parts = all_gather(buffer) if gather is None else gather(buffer)
    if parts is None:
        return None
    return [
        (part[: shape[0]] if shape else part).to(device=tensor.device, dtype=tensor.dtype)
        for part, shape in zip(parts, shapes, strict=True)
    ]


def nan_sums_and_counts(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """``reduce_dict(ignore_nan=True)``'s payload: every leaf with its NaNs as zeros, then
    every leaf's count of values that are not NaN."""
    sums, counts = [], []
    for leaf in leaves:
        value = leaf if leaf.is_floating_point() else leaf.to(torch.float64)
        missing = torch.isnan(value)
        sums.append(torch.where(missing, torch.zeros_like(value), value))
        counts.append((~missing).to(value.dtype))
    return sums + counts


def nan_ignoring_results(totals: list[torch.Tensor], average: bool) -> list[torch.Tensor]:
    """The reduced sums divided by their counts (when ``average``); NaN where no rank had a
    value."""
    half = len(totals) // 2
    results = []
    for total, count in zip(totals[:half], totals[half:], strict=True):
        value = total / count if average else total
        results.append(torch.where(count > 0, value, torch.full_like(total, float("nan"))))
    return results
