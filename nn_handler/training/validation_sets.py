"""ValidationSets: the validation loaders of a fit, one or several (Lightning's several
validation dataloaders). One loader records ``val_<metric>``; several record each metric per
set, ``val_<metric>/<name>`` for a dict's names and ``val_<metric>/dataloader_idx_<i>`` for a
list's (Lightning's names), in the epoch record, the epoch's line and the trackers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from nn_handler.data.fixed_batches import FixedEvalLoader
from nn_handler.errors import ConfigError

#: A loader of one set, the set's name (None: the only one) -> its metrics and a hook error.
Evaluate = Callable[[Iterable[Any], str | None], tuple[dict[str, float], Exception | None]]


def is_several(value: Any) -> bool:
    """Whether ``value`` names several validation sets: a dict of them, or a list or tuple of
    DataLoaders (a list of batches is one loader)."""
    if isinstance(value, Mapping):
        return True
    loaders = (DataLoader, FixedEvalLoader)
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(item, loaders) for item in value
    )  # fmt: skip


def set_names(value: Mapping[Any, Any] | Sequence[Any]) -> list[str]:
    """The names of several sets: a dict's (non-empty strings without '/'), a list's
    ``dataloader_idx_<i>``."""
    if not isinstance(value, Mapping):
        return [f"dataloader_idx_{index}" for index in range(len(value))]
    if not value:
        raise ConfigError("validation data is an empty dict; pass at least one named set.")
    bad = [name for name in value if not isinstance(name, str) or not name or "/" in name]
    if bad:
        raise ConfigError(
            f"validation sets are named by non-empty strings without '/', got {bad!r}; their "
            f"metrics are recorded as val_<metric>/<name>."
        )
    return list(value)


@dataclass(frozen=True)
class ValidationSets:
    """A fit's validation loaders by name (one unnamed set: the plain ``val_`` keys)."""

    sets: tuple[tuple[str | None, Iterable[Any]], ...]

    @classmethod
    def of(cls, value: Any) -> ValidationSets:
        """``value`` as given to ``fit``: None, one loader, a dict of them by name, or a list
        of DataLoaders."""
        if isinstance(value, ValidationSets):
            return value
        if value is None:
            return cls(())
        if not is_several(value):
            return cls(((None, value),))
        loaders = list(value.values()) if isinstance(value, Mapping) else list(value)
        return cls(tuple(zip(set_names(value), loaders, strict=True)))

    def due(self, epoch: int, every: int) -> ValidationSets:
        """The sets epoch ``epoch`` (0-based) validates on: all of them every ``every``-th
        epoch (check_val_every_n_epoch), none in the others."""
        return self if (epoch + 1) % every == 0 else ValidationSets(())

    def __bool__(self) -> bool:
        return bool(self.sets)

    @property
    def loaders(self) -> list[Iterable[Any]]:
        return [loader for _, loader in self.sets]

    @property
    def names(self) -> list[str]:
        """The sets' names (none for one unnamed set)."""
        return [name for name, _ in self.sets if name is not None]

    def validate(self, evaluate: Evaluate) -> tuple[dict[str, float], Exception | None]:
        """Every set evaluated in turn (each one agreed on every rank, so every rank must call
        this): the record's ``val_`` keys, and the first error a set's after_validation hooks
        raised on this rank (the others are still evaluated: every rank runs every set)."""
        record: dict[str, float] = {}
        first: Exception | None = None
        for name, loader in self.sets:
            metrics, error = evaluate(loader, name)
            first = first or error
            record.update({f"val_{key}": value for key, value in metrics.items()})
        return record, first


def named(metrics: Mapping[str, float], name: str | None) -> dict[str, float]:
    """A set's metrics under its name (``loss`` -> ``loss/<name>``; one unnamed set: as they
    are)."""
    return dict(metrics) if name is None else {f"{k}/{name}": v for k, v in metrics.items()}


__all__ = ["Evaluate", "ValidationSets", "is_several", "named", "set_names"]
