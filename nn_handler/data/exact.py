"""Exact distributed evaluation: gather outputs back into dataset order, weight metrics by
sample counts. Every rank must call these, after its evaluation loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError


def _leaves(outputs: Any) -> dict[str, torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return {"": outputs}
    if isinstance(outputs, Mapping) and all(isinstance(v, torch.Tensor) for v in outputs.values()):
        return dict(outputs)
    raise ConfigError(
        f"outputs must be a tensor or a dict of tensors (per-sample values along dim 0), got "
        f"{type(outputs).__name__}."
    )


def gather_in_dataset_order(
    outputs: torch.Tensor | Mapping[str, torch.Tensor],
    indices: Sequence[int],
    comm: Communicator,
    total: int | None = None,
) -> Any:
    """Every rank gets all ranks' per-sample outputs, placed in dataset order.

    ``outputs`` (a tensor or dict of tensors) holds this rank's per-sample results along dim 0,
    in the order of ``indices`` (an evaluation loader's ``indices``); ranks may hold different
    counts and trailing shapes must match. With ``total``, the gathered indices must cover
    0..total-1 exactly once. Every rank must call this; a mismatch on any rank raises on every
    rank (RankFailedError), naming it.
    """
    error: BaseException | None = None
    try:
        leaves = _leaves(outputs)
        for name, value in leaves.items():
            if value.shape[0] != len(indices):
                raise ConfigError(
                    f"outputs{f'[{name!r}]' if name else ''} has {value.shape[0]} rows but this "
                    f"rank visited {len(indices)} samples."
                )
    except ConfigError as caught:
        error = caught
    comm.raise_if_any_failed(error, "gather_in_dataset_order: checking outputs")
    local = torch.as_tensor(list(indices), dtype=torch.int64)
    order = comm.gather_into_tensor(local)
    n = int(order.numel())
    expected = total if total is not None else n
    if n != expected or not torch.equal(torch.sort(order).values, torch.arange(expected)):
        raise ConfigError(
            f"the ranks' indices do not cover 0..{expected - 1} exactly once ({n} gathered); "
            f"use an evaluation loader's indices."
        )
    placed: dict[str, torch.Tensor] = {}
    for name, value in leaves.items():
        gathered = comm.gather_into_tensor(value)
        result = torch.empty_like(gathered)
        result[order.to(gathered.device)] = gathered
        placed[name] = result
    return placed[""] if isinstance(outputs, torch.Tensor) else placed


def weighted_mean(
    metrics: Mapping[str, float | torch.Tensor], count: int, comm: Communicator
) -> dict[str, float]:
    """Average per-rank metric means weighted by each rank's sample ``count`` (float64).

    With ranks holding different numbers of samples (exact evaluation), this equals the mean a
    single process computes over all samples. Every rank must call this with the same keys.
    """
    keys = sorted(metrics)
    values = [float(metrics[k]) * count for k in keys] + [float(count)]
    totals = comm.all_reduce(torch.tensor(values, dtype=torch.float64))
    denominator = float(totals[-1])
    if denominator == 0:
        return {k: float("nan") for k in keys}
    return {k: float(totals[i]) / denominator for i, k in enumerate(keys)}


__all__ = ["gather_in_dataset_order", "weighted_mean"]
