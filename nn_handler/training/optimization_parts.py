"""The checkpoint parts of Optimization (optimization.py): the optimizers through the
strategy's views (sharded ones in DCP shards), the schedulers and the EMA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nn_handler.checkpoint.registry import Part
from nn_handler.errors import CheckpointError
from nn_handler.strategies import Strategy
from nn_handler.training.ema import ModelEma
from nn_handler.training.sharded_ema import ShardedEma


def optimizer_parts(strategy: Strategy, optimizers: list[torch.optim.Optimizer]) -> list[Part]:
    """``optimizer`` (the first one, when there is one) and ``optimizers`` (the second and later
    ones of manual optimization, in order). ``optimizers`` is read when saving and loading."""
    parts: list[Part] = []
    if optimizers:
        first = optimizers[0]
        parts.append(
            Part(
                "optimizer",
                lambda: strategy.optimizer_state_dict(first),
                lambda state, _source: strategy.load_optimizer_state_dict(first, state),
                collective=strategy.collective_state,
                shards=lambda: strategy.optimizer_shards(first),
                load_shards=lambda state, _source: strategy.load_optimizer_shards(first, state),
            )
        )
    parts.append(
        Part(
            "optimizers",
            lambda: [strategy.optimizer_state_dict(o) for o in optimizers[1:]],
            lambda states, source: _load_more(
                optimizers[1:], states, "optimizer", source, strategy.load_optimizer_state_dict
            ),
            missing="ignore",
            collective=strategy.collective_state,
            # DCP keys are names: the second optimizer is "1", and so on.
            shards=lambda: {
                str(i): strategy.optimizer_shards(o) for i, o in enumerate(optimizers[1:], 1)
            },
            load_shards=lambda states, source: _load_more(
                optimizers[1:],
                [states[str(i)] for i in range(1, len(optimizers))],
                "optimizer",
                source,
                strategy.load_optimizer_shards,
            ),
        )
    )
    return parts


def scheduler_parts(
    schedulers: list[Any], first: bool, load_first: Callable[[Any, str], None]
) -> list[Part]:
    """``scheduler`` (when ``first``: there is one, or one is built at the start of fit, which
    ``load_first`` keeps the state for) and ``schedulers`` (the second and later ones)."""
    parts: list[Part] = []
    if first:
        parts.append(
            Part(
                "scheduler",
                lambda: schedulers[0].state_dict() if schedulers else None,
                load_first,
            )
        )
    parts.append(
        Part(
            "schedulers",
            lambda: [s.state_dict() for s in schedulers[1:]],
            lambda states, source: _load_more(
                schedulers[1:],
                states,
                "scheduler",
                source,
                lambda scheduler, state: scheduler.load_state_dict(state),
            ),
            missing="ignore",
        )
    )
    return parts


def ema_part(ema: ModelEma | ShardedEma) -> Part:
    """The EMA: a sharded one gathered whole like the model (a collective), or in shards."""
    if isinstance(ema, ShardedEma):
        return Part(
            "ema",
            ema.state_dict,
            ema.load_state_dict,
            collective=True,
            shards=ema.shards,
            load_shards=ema.load_shards,
        )
    return Part(
        "ema",
        ema.state_dict,
        lambda state, _source: ema.load_state_dict(state),
        shards=ema.state_dict,
        load_shards=lambda state, _source: ema.load_state_dict(state),
    )


def _load_more(
    targets: list[Any],
    states: list[Any],
    kind: str,
    source: str,
    load: Callable[[Any, Any], Any],
) -> None:
    """The second and later optimizers (or schedulers) of manual optimization."""
    if len(targets) != len(states):
        raise CheckpointError(
            f"{source} holds {len(states) + 1} {kind}s' states but this run has "
            f"{len(targets) + 1}; build the {kind}s the same way as the run that wrote it."
        )
    for index, (target, state) in enumerate(zip(targets, states, strict=True), start=1):
        try:
            load(target, state)
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"cannot load the {kind} {index} state from {source}: {error}. Build the "
                f"{kind}s the same way as the run that wrote it."
            ) from error


__all__ = ["ema_part", "optimizer_parts", "scheduler_parts"]
