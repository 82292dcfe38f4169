"""ShardedEma: the exponential moving average of a sharded model (FSDP2), kept sharded.

An FSDP2 module cannot be copied, and a full copy would defeat the sharding: each rank keeps
an averaged copy of its own shard of every parameter (and of the buffers, which FSDP2 does not
shard), updated with the same foreach kernels as ModelEma. To evaluate with it, or to save it,
the averaged shards are swapped into the model for the duration (``applied()``) and the
training shards put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from nn_handler.config.training import EmaConfig
from nn_handler.training.ema import EmaUpdates, _grouped


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class ModuleViews(Protocol):
    """A strategy's views of a module's state: whole (single-file checkpoints) and sharded
    (DCP). Every rank must call each."""

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]: ...

    def load_module_state_dict(
        self, module: nn.Module, state: Mapping[str, Any], source: str
    ) -> None: ...

    def model_shards(self, module: nn.Module) -> dict[str, Any]: ...

    def load_model_shards(
        self, module: nn.Module, state: Mapping[str, Any], source: str
    ) -> None: ...


class ShardedEma(EmaUpdates):
    """The EMA of a sharded ``model``, one shard per rank (the update rule is ModelEma's,
    on this rank's shards); every rank must call ``update``,
    ``applied`` and the state methods alike.

    ``views`` are the strategy's views of a module's state: a single-file checkpoint keeps the
    EMA whole, like the model (``state_dict``); a sharded one keeps it sharded (``shards``).
    """

    def __init__(self, model: nn.Module, config: EmaConfig, views: ModuleViews) -> None:
        self.config = config
        self.model = model
        self.views = views
        with torch.no_grad():
            self._live = [_local(p) for p in model.parameters()] + list(model.buffers())
            self._shadow = [t.detach().clone() for t in self._live]
        params = len(list(model.parameters()))  # the first ones; buffers follow
        averaged = [
            (s, t)
            for i, (s, t) in enumerate(zip(self._shadow, self._live, strict=True))
            if s.is_floating_point() and (i < params or config.buffers == "average")
        ]
        ids = {id(s) for s, _ in averaged}
        copied = [(s, t) for s, t in zip(self._shadow, self._live, strict=True) if id(s) not in ids]
        self._averaged = _grouped(averaged)
        self._copied = _grouped(copied)
        self.num_updates = 0
        self._optimizer_steps = 0

    @contextlib.contextmanager
    def applied(self) -> Iterator[nn.Module]:
        """The model holding the averaged weights for the duration (its own put back after)."""
        with torch.no_grad():
            saved = [t.clone() for t in self._live]
            torch._foreach_copy_(self._live, self._shadow)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._live, saved)

    def state_dict(self) -> dict[str, Any]:
        """The whole averaged model (gathered to rank 0 by the strategy's view: a collective)."""
        return self._saved(self.views.module_state_dict)

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        self._load(self.views.load_module_state_dict, state, source)

    def shards(self) -> dict[str, Any]:
        """The averaged model as this rank's shards (DTensors), for a sharded checkpoint;
        never gathered."""
        return self._saved(self.views.model_shards)

    def load_shards(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Take back a state of the form ``shards`` returns (filled by DCP)."""
        self._load(self.views.load_model_shards, state, source)

    def _saved(self, view: Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
        with self.applied() as model:
            module = _copied(view(model))
        return {
            "module": module,
            "num_updates": self.num_updates,
            "optimizer_steps": self._optimizer_steps,
        }

    def _load(
        self,
        view: Callable[[nn.Module, Mapping[str, Any], str], None],
        state: Mapping[str, Any],
        source: str,
    ) -> None:
        with self.applied() as model:
            view(model, state["module"], source)
            with torch.no_grad():
                torch._foreach_copy_(self._shadow, self._live)
        self.num_updates = int(state["num_updates"])
        self._optimizer_steps = int(state["optimizer_steps"])

    def __repr__(self) -> str:
        return f"ShardedEma(decay={self.config.decay}, updates={self.num_updates})"


def _copied(state: Mapping[str, Any]) -> dict[str, Any]:
    """Copies of a state's tensors: a view may share the model's storage, which gets its own
    weights back when ``applied`` ends."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


__all__ = ["ModuleViews", "ShardedEma"]
