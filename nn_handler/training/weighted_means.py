"""Sample-weighted means of named per-batch values, exact over ranks, reduced in one
collective.

Per batch, ``update`` only appends (no tensor op, no host sync); every ``fold_every`` batches
the pending values are folded into float64 sums and counts on their device in a few tensor ops
per key. ``reduce`` sends every key's sum, count and presence, with the caller's own values
(``extra``), in one all_reduce: the key set is agreed without an object gather when it is the
one the ranks agreed on last time (``MetricKeys`` remembers it), or by a 60-bit hash of the
sorted keys the first time; only a real difference costs an object gather of the key names.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from loguru import logger

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError

Value = torch.Tensor | float
_HASH_CHUNKS = 3  # 20-bit chunks: sums of squares stay exact in float64 up to 8,192 ranks
_CHUNK_BITS = 20


class _Layout:
    """Where each value sits in a reduction vector built by ``WeightedMeans._vector``."""

    def __init__(
        self, on_device: int, head: int, tensors: list[int], numbers: list[int], keys: int
    ) -> None:
        self.on_device, self.head, self.keys = on_device, head, keys
        self.tensors, self.numbers = tensors, numbers

    def head_values(self, totals: Sequence[float]) -> list[float]:
        return list(totals[self.on_device : self.on_device + self.head])

    def extra(self, totals: Sequence[float]) -> list[float]:
        values = [0.0] * (len(self.tensors) + len(self.numbers))
        for position, i in enumerate(self.tensors):
            values[i] = totals[position]
        host = self.on_device + self.head
        for position, i in enumerate(self.numbers):
            values[i] = totals[host + position]
        return values

    def key_totals(self, totals: Sequence[float]) -> tuple[list[float], list[float]]:
        k, device = self.keys, len(self.tensors)
        host = self.on_device + self.head + len(self.numbers)
        sums = [totals[device + i] + totals[host + i] for i in range(k)]
        counts = [totals[device + k + i] + totals[host + k + i] for i in range(k)]
        return sums, counts

    def presence(self, totals: Sequence[float]) -> list[float]:
        start = self.on_device + self.head + len(self.numbers) + 2 * self.keys
        return list(totals[start : start + self.keys])


class MetricKeys:
    """The key set every rank agreed on in the last reduction (the same on every rank), so the
    next one sends its values by position with no agreement round. Keep one per purpose
    (validation metrics, training extras) for the life of a run."""

    def __init__(self, what: str = "metric") -> None:
        self.keys: tuple[str, ...] | None = None
        self.what = what
        #: Keys already reported as returned by some ranks only (each is said once).
        self.partial: set[str] = set()


class WeightedMeans:
    """Sample-weighted means of named values over every rank, NaN-aware.

    ``update(values, n)`` adds per-batch means weighted by the batch's sample count ``n``; a
    NaN value is left out of its key's sum and count. ``compute(comm)`` returns, on every rank,
    each key's total over all ranks divided by its count (NaN when no rank counted any) for
    every key any rank saw: the mean one process would compute over all samples. Every rank
    must call ``compute`` (or ``reduce``), also a rank that saw no batch.
    """

    def __init__(self, fold_every: int = 64) -> None:
        self.fold_every = fold_every
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._weights: dict[str, list[int]] = {}
        self._float_sums: dict[str, float] = {}  # Python numbers keep their double precision
        self._float_counts: dict[str, float] = {}
        self._updates = 0

    def update(self, values: Mapping[str, Value], n: int) -> None:
        pending, weights = self._pending, self._weights
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                if key not in pending:
                    pending[key], weights[key] = [], []
                pending[key].append(value.detach() if value.requires_grad else value)
                weights[key].append(n)
            else:
                number = float(value)
                self._float_sums.setdefault(key, 0.0)
                self._float_counts.setdefault(key, 0.0)
                if number == number:  # not NaN
                    self._float_sums[key] += number * n
                    self._float_counts[key] += n
        self._updates += 1
        if self._updates >= self.fold_every:
            self.fold()

    def fold(self) -> None:
        """Fold the pending tensor values into the per-key sums and counts (on their device):
        the keys that saw the same batches fold together, in one stack and a few ops."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for key, values in self._pending.items():
            if values:
                groups.setdefault(tuple(self._weights[key]), []).append(key)
        for weights, keys in groups.items():
            values = [v for key in keys for v in self._pending[key]]
            wrong = [key for key in keys if self._pending[key][0].numel() != 1]
            if wrong:
                raise ConfigError(
                    f"the values {wrong} must be scalars (per-batch means), got a tensor of "
                    f"shape {tuple(self._pending[wrong[0]][0].shape)}; return 0-dim tensors or "
                    f"floats (average per-sample values in validation_step)."
                )
            try:
                stacked = torch.stack(values)
            except RuntimeError:  # shapes differ: 0-dim and (1,) side by side, or worse
                scalar = all(v.numel() == 1 for v in values)
                stacked = torch.stack([v.reshape(()) for v in values]) if scalar else values[0]
            if stacked.numel() != len(values):  # a later value that is not a scalar
                raise ConfigError(
                    f"the values {keys} must all be scalars (per-batch means); one batch gave "
                    f"a tensor of more than one element."
                )
            stacked = stacked.to(torch.float64).reshape(len(keys), len(weights))
            w = torch.tensor(weights, dtype=torch.float64, device=stacked.device)
            sums = (stacked * w).nansum(1).unbind()  # a NaN value leaves its sum and count
            counts = (~torch.isnan(stacked) * w).sum(1).unbind()
            for key, total, count in zip(keys, sums, counts, strict=True):
                if key in self._sums:
                    self._sums[key] = self._sums[key] + total
                    self._counts[key] = self._counts[key] + count
                else:
                    self._sums[key], self._counts[key] = total, count
                self._pending[key].clear()
                self._weights[key].clear()
        self._updates = 0

    def reset(self) -> None:
        for part in (self._sums, self._counts, self._pending, self._weights):
            part.clear()
        self._float_sums.clear()
        self._float_counts.clear()
        self._updates = 0

    def keys(self) -> list[str]:
        """Every key this rank saw, sorted."""
        return sorted(set(self._sums) | set(self._pending) | set(self._float_sums))

    def __bool__(self) -> bool:
        return bool(self._sums or self._pending or self._float_sums)

    def local_means(self) -> dict[str, float]:
        """This rank's running mean of every key (host syncs; for display only)."""
        return {key: self.local_mean(key) for key in self.keys()}

    def local_mean(self, key: str) -> float:
        """This rank's running mean of ``key`` (a host sync; for display only)."""
        self.fold()
        if key not in self._sums and key not in self._float_sums:
            return math.nan
        total, count = self._float_sums.get(key, 0.0), self._float_counts.get(key, 0.0)
        if key in self._sums:
            total += float(self._sums[key])
            count += float(self._counts[key])
        return total / count if count else math.nan

    def state_dict(self) -> dict[str, Any]:
        """The exact partial state: pending values unfolded, so a resumed epoch folds at the
        same points and sums alike."""
        return {
            "sums": dict(self._sums),
            "counts": dict(self._counts),
            "pending": {k: list(v) for k, v in self._pending.items()},
            "weights": {k: list(v) for k, v in self._weights.items()},
            "float_sums": dict(self._float_sums),
            "float_counts": dict(self._float_counts),
            "updates": self._updates,
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        """Restore a ``state_dict`` (also the first format: sums and counts only)."""
        self.reset()
        self._sums = {k: v.to(device) for k, v in state["sums"].items()}
        self._counts = {k: v.to(device) for k, v in state["counts"].items()}
        self._pending = {k: [t.to(device) for t in v] for k, v in state.get("pending", {}).items()}
        self._weights = {k: [int(n) for n in v] for k, v in state.get("weights", {}).items()}
        self._float_sums = {k: float(v) for k, v in state.get("float_sums", {}).items()}
        self._float_counts = {k: float(v) for k, v in state.get("float_counts", {}).items()}
        self._updates = int(state.get("updates", 0))

    def compute(self, comm: Communicator, device: torch.device | None = None) -> dict[str, float]:
        """Every rank gets the exact global mean of every key any rank saw. Every rank must
        call this."""
        return self.reduce(comm, device)[0]

    def reduce(
        self,
        comm: Communicator,
        device: torch.device | None = None,
        keys: MetricKeys | None = None,
        extra: Sequence[torch.Tensor | float] = (),
    ) -> tuple[dict[str, float], list[float]]:
        """(every key's global mean, the sum over ranks of each ``extra`` value). Every rank
        must call this with as many ``extra`` values (0-dim tensors or numbers). ``keys``
        remembers the agreed key set between calls: with the same keys as last time this is
        one all_reduce (two the first time; a new key costs an object gather of the names)."""
        self.fold()
        where = device or self._device()
        cache = keys if keys is not None else MetricKeys()
        local = self.keys()
        if comm.world_size == 1:  # no agreement to make; still one (identity) reduction
            vector, layout = self._vector(local, [], extra, where)
            totals = _as_floats(comm.all_reduce_(vector))
            return self._means(local, totals, layout), layout.extra(totals)
        known = cache.keys
        if known is not None:
            unknown = float(not set(local) <= set(known))
            vector, layout = self._vector(known, [unknown], extra, where)
            totals = _as_floats(comm.all_reduce_(vector))
            extra_totals = layout.extra(totals)
            if layout.head_values(totals)[0] == 0:  # nobody saw a key outside the agreed set
                return self._means(known, totals, layout), extra_totals
            agreed = self._gathered_union(comm, local, cache)
        else:  # the first reduction: agree by hashing the sorted keys (no object gather)
            vector, layout = WeightedMeans()._vector([], _hash_terms(local), extra, where)
            totals = _as_floats(comm.all_reduce_(vector))
            extra_totals = layout.extra(totals)
            head = layout.head_values(totals)
            same = all(  # exact integers: each term below 2**53, compared as Python ints
                comm.world_size * int(head[2 * i + 1]) == int(head[2 * i]) ** 2
                for i in range(_HASH_CHUNKS)
            )
            agreed = tuple(local) if same else self._gathered_union(comm, local, cache)
        cache.keys = agreed
        if not agreed:
            return {}, extra_totals
        vector, layout = self._vector(agreed, [], (), where)
        totals = _as_floats(comm.all_reduce_(vector))
        return self._means(agreed, totals, layout), extra_totals

    # ----------------------------------------------------------------- internals
    def _device(self) -> torch.device:
        """Where the values live (the first folded or pending tensor's device), else CPU."""
        tensors = [*self._sums.values(), *(v[0] for v in self._pending.values() if v)]
        return tensors[0].device if tensors else torch.device("cpu")

    def _vector(
        self,
        keys: Sequence[str],
        head: Sequence[float],
        extra: Sequence[torch.Tensor | float],
        where: torch.device,
    ) -> tuple[torch.Tensor, _Layout]:
        """One float64 vector: the device values first (tensor extras, then each key's sum
        and count), then the host values (``head``, number extras, each key's Python-number
        sum and count, and whether this rank saw it). Two tensor ops besides the reduction."""
        zero = torch.zeros((), dtype=torch.float64, device=where)
        tensors = [i for i, v in enumerate(extra) if isinstance(v, torch.Tensor)]
        numbers = [i for i, v in enumerate(extra) if not isinstance(v, torch.Tensor)]
        device_values = [_as_tensor(extra[i], where) for i in tensors]
        device_values += [self._sums.get(k, zero) for k in keys]
        device_values += [self._counts.get(k, zero) for k in keys]
        present = set(self.keys())
        host = [
            *head,
            *(float(extra[i]) for i in numbers),
            *(self._float_sums.get(k, 0.0) for k in keys),
            *(self._float_counts.get(k, 0.0) for k in keys),
            *(float(k in present) for k in keys),
        ]
        host_tensor = torch.tensor(host, dtype=torch.float64, device=where)
        parts = [torch.stack(device_values).to(where), host_tensor] if device_values else []
        vector = torch.cat(parts) if parts else host_tensor
        return vector, _Layout(len(device_values), len(head), tensors, numbers, len(keys))

    @staticmethod
    def _means(keys: Sequence[str], totals: Sequence[float], layout: _Layout) -> dict[str, float]:
        sums, counts = layout.key_totals(totals)
        present = layout.presence(totals)
        means: dict[str, float] = {}
        for i, key in enumerate(keys):
            if present[i] > 0:  # some rank saw the key in this reduction
                means[key] = sums[i] / counts[i] if counts[i] else math.nan
        return means

    @staticmethod
    def _gathered_union(comm: Communicator, local: list[str], keys: MetricKeys) -> tuple[str, ...]:
        """Every rank's keys, united; a key some ranks did not return is said once (its mean
        is over those ranks' samples only)."""
        per_rank = comm.all_gather_object(local)
        union = sorted(set().union(*per_rank))
        for key in union:
            having = [rank for rank, rank_keys in enumerate(per_rank) if key in rank_keys]
            if len(having) < len(per_rank) and key not in keys.partial:
                keys.partial.add(key)
                logger.bind(rank=comm.rank).warning(
                    "{} {!r} came from rank(s) {} only (of {}): its value is the mean over "
                    "those ranks' samples, not the whole set's (a value computed under `if "
                    "rank == 0`, or a metric some shards cannot give?)",
                    keys.what,
                    key,
                    having,
                    len(per_rank),
                )
        return tuple(union)


def _hash_terms(keys: Sequence[str]) -> list[float]:
    """Per 20-bit chunk of a 60-bit hash of ``keys``: (h, h*h). Summed over W ranks, every
    rank's hash is equal exactly when W * sum(h*h) == sum(h)**2 (equality in Cauchy-Schwarz),
    a test every rank decides alike from the same totals."""
    text = "\0".join(keys).encode()
    digest = zlib.crc32(text) | (zlib.adler32(text) << 32)
    terms: list[float] = []
    for i in range(_HASH_CHUNKS):
        chunk = float((digest >> (_CHUNK_BITS * i)) & ((1 << _CHUNK_BITS) - 1))
        terms += [chunk, chunk * chunk]
    return terms


def _as_tensor(value: torch.Tensor | float, where: torch.device) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    tensor = tensor.detach().to(device=where, dtype=torch.float64)
    return tensor if tensor.dim() == 0 else tensor.reshape(())


def _as_floats(tensor: torch.Tensor) -> list[float]:
    return [float(v) for v in tensor.cpu().tolist()]


__all__ = ["MetricKeys", "WeightedMeans"]
