"""ExactMeans: validation means of the reproducible mode, the same bits at any world size.

Evaluation batches are fixed (batch ``j`` of the dataset order, on rank ``j % W``:
data/fixed_batches.FixedEvalLoader), so each batch's values do not depend on W; only their sum
would. Each rank writes its batches' values (times their samples) and counts into the rows of
a table that only it fills; one int64 sum of the table's bit patterns (fixed_point.as_slots)
gives every rank the whole table, summed per key in batch order with ``math.fsum`` (correctly
rounded). The drop-in for WeightedMeans in ``Evaluator.evaluate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.training.reproducible import fixed_point


class ExactMeans:
    """Sample-weighted means of named per-batch values over the fixed batches ``batch_ids``
    (this rank's, in the order it visits them) of ``total_batches``."""

    def __init__(self, batch_ids: Sequence[int], total_batches: int) -> None:
        self.batch_ids = list(batch_ids)
        self.total_batches = total_batches
        self._rows: list[tuple[int, dict[str, Any], int]] = []

    def update(self, values: Mapping[str, torch.Tensor | float], n: int) -> None:
        """One batch's values (its per-batch means) and its samples, in loader order."""
        seen = len(self._rows)
        if seen >= len(self.batch_ids):
            raise ConfigError(
                f"the validation loader gave more than its {len(self.batch_ids)} batches; the "
                f"reproducible mode evaluates on the LoaderFactory's fixed batches."
            )
        self._rows.append((self.batch_ids[seen], dict(values), n))

    def fold(self) -> None:
        """Turn the values into floats (a value that is not a scalar fails here)."""
        folded = []
        for j, values, n in self._rows:
            floats: dict[str, Any] = {}
            for key, value in values.items():
                tensor = torch.as_tensor(value)
                if tensor.numel() != 1:
                    raise ConfigError(
                        f"validation value {key!r} has shape {tuple(tensor.shape)}; return "
                        f"per-batch means (one number each)."
                    )
                floats[key] = float(tensor.reshape(()).item())
            folded.append((j, floats, n))
        self._rows = folded

    def keys(self) -> list[str]:
        return sorted({key for _, values, _ in self._rows for key in values})

    def reduce(
        self,
        comm: Communicator,
        device: torch.device | None = None,
        keys: Any = None,
        extra: Sequence[torch.Tensor | float] = (),
    ) -> tuple[dict[str, float], list[float]]:
        """(every key's exact mean, the sum over ranks of each integral ``extra`` value).
        Every rank must call this with as many ``extra`` values."""
        self.fold()
        local = self.keys()
        names = sorted({k for ks in comm.all_gather_object(local) for k in ks}) if (
            comm.world_size > 1
        ) else local  # fmt: skip
        where = device or torch.device("cpu")
        table = torch.zeros((self.total_batches, 2 * len(names)), dtype=torch.float64)
        column = {name: i for i, name in enumerate(names)}
        for j, values, n in self._rows:
            for key, value in values.items():
                table[j, 2 * column[key]] = value * n
                table[j, 2 * column[key] + 1] = float(n)
        counts = torch.tensor([round(float(x)) for x in extra], dtype=torch.int64)
        buffer = torch.cat([fixed_point.as_slots(table).reshape(-1), counts]).to(where)
        comm.all_reduce_(buffer, "sum")
        summed = fixed_point.from_slots(buffer[: table.numel()].cpu()).reshape(table.shape)
        results: dict[str, float] = {}
        for name, i in column.items():
            total = math.fsum(summed[:, 2 * i].tolist())
            count = math.fsum(summed[:, 2 * i + 1].tolist())
            results[name] = total / count if count else math.nan
        return results, [float(x) for x in buffer[table.numel() :].tolist()]


__all__ = ["ExactMeans"]
