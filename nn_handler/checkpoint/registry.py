"""StateRegistry: the named stateful parts a checkpoint holds, collected and restored without
knowing whose they are: shared (one state, rank 0's) or per rank (RNG streams, partial sums).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

import torch
from loguru import logger

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: What a part does when the checkpoint has no state for it.
Missing = Literal["warn", "error", "ignore"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class Part:
    """One named entry of a checkpoint.

    Attributes:
        name: its key in the checkpoint.
        save: returns its state; ``load(state, source)`` takes it back (source: for errors).
        per_rank: every rank saves and restores its own state.
        missing: a checkpoint without it: warn and start fresh, raise, or say nothing.
        on_resize: a per-rank part on another number of ranks: take rank 0's or keep its own.
        collective: ``save`` runs on every rank (else a shared part's runs on rank 0 only).
        shards: in a sharded checkpoint, its state as DCP saves it (every rank; also the
            template DCP fills when loading), given back to ``load_shards(state, source)``.
            None: the part goes with the unsharded ones.
    """

    name: str
    save: Callable[[], Any]
    load: Callable[[Any, str], Any]
    per_rank: bool = False
    missing: Missing = "warn"
    on_resize: Literal["rank0", "keep"] = "keep"
    collective: bool = False
    shards: Callable[[], Any] | None = None
    load_shards: Callable[[Any, str], Any] | None = None


def part_of(
    name: str,
    obj: Stateful,
    *,
    per_rank: bool = False,
    missing: Missing = "warn",
    on_resize: Literal["rank0", "keep"] = "keep",
) -> Part:
    """The Part of a Stateful object."""
    return Part(
        name,
        obj.state_dict,
        lambda state, _source: obj.load_state_dict(state),
        per_rank,
        missing=missing,
        on_resize=on_resize,
    )


def tracked_part(name: str, obj: object) -> Part:
    """The Part of a user's ``track``-ed object (``tracked.<name>``: each rank's own state,
    rank 0's for every rank after a change of world size); a ConfigError naming what is
    missing when ``name`` is empty or ``obj`` is not Stateful."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"track needs a non-empty str name, got {name!r}.")
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"track({name!r}, ...): {type(obj).__name__} has no {' or '.join(missing)}; "
            f"track an object with state_dict() and load_state_dict(state)."
        )
    return part_of(f"tracked.{name}", cast(Stateful, obj), per_rank=True, on_resize="rank0")


class StateRegistry:
    """The named parts of a checkpoint, in the order they are saved and restored."""

    def __init__(self, parts: Iterable[Part] = ()) -> None:
        self._parts: dict[str, Part] = {}
        for part in parts:
            self.add(part)

    def add(self, part: Part, *, replace: bool = False) -> None:
        """Register ``part``; a name registered twice is an error unless ``replace``."""
        if part.name in self._parts and not replace:
            raise CheckpointError(f"the checkpoint part {part.name!r} is registered twice.")
        self._parts[part.name] = part

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def names(self, per_rank: bool | None = None) -> list[str]:
        return [p.name for p in self._parts.values() if per_rank is None or p.per_rank == per_rank]

    def sharded(self) -> list[Part]:
        """The parts a sharded checkpoint writes through DCP (those with ``shards``)."""
        return [p for p in self._parts.values() if p.shards is not None]

    def track(self, name: str, obj: object) -> None:
        """Add ``obj`` (anything with ``state_dict`` and ``load_state_dict``) as the per-rank
        part ``tracked.<name>``."""
        self.add(tracked_part(name, obj))

    def load_shards(
        self, folder: Path, names: list[str], group: ProcessGroup | None, source: str
    ) -> list[str]:
        """Give every sharded part of this registry that the sharded checkpoint ``folder``
        holds (``names``) its state, resharded to this run; returns the names of the parts
        saved there that this registry has no shards of. Every rank must call this."""
        from nn_handler.checkpoint.sharded import load_shards

        parts = [p for p in self.sharded() if p.name in names]
        template = {p.name: p.shards() for p in parts if p.shards is not None}
        load_shards(folder, template, group)  # raises alike on every rank
        for part in parts:
            restore_shards(part, template[part.name], source)
        return sorted(set(self.names()) & set(names) - set(template))

    def collect(
        self, comm: Communicator, skip: Collection[str] = ()
    ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(shared states, every rank's states) on rank 0, None elsewhere; the parts named in
        ``skip`` are left out. Every rank must call this (one gather_object of the per-rank
        states when there are several ranks)."""
        parts = [p for p in self._parts.values() if p.name not in skip]
        mine = {p.name: p.save() for p in parts if p.per_rank}
        collective = {p.name: p.save() for p in parts if p.collective and not p.per_rank}
        ranks = comm.gather_object(mine, dst=0) if comm.world_size > 1 else [mine]
        if comm.rank != 0:
            return None
        shared = {
            p.name: collective[p.name] if p.collective else p.save()
            for p in parts
            if not p.per_rank
        }
        return shared, list(ranks)

    def restore(
        self,
        shared: Mapping[str, Any],
        ranks: Sequence[Mapping[str, Any]],
        rank: int,
        source: str,
        *,
        same_world: bool = True,
        ignore: Iterable[str] = (),
        skip: Collection[str] = (),
    ) -> None:
        """Give every part its saved state: shared parts from ``shared``, per-rank parts from
        ``ranks[rank]`` (after a change of world size, ``on_resize`` decides). Every rank must
        call this with the same checkpoint. Keys no part uses are named once (an info line);
        ``ignore`` lists keys that are not parts; the parts named in ``skip`` are restored
        elsewhere (a sharded checkpoint's)."""
        unused_ok = set(ignore) | set(skip)
        restored = [p for p in self._parts.values() if p.name not in skip]
        for part in restored:
            if not part.per_rank:
                _restore(part, shared.get(part.name), source)
        mine: Mapping[str, Any] | None = ranks[rank] if same_world and rank < len(ranks) else None
        first: Mapping[str, Any] = ranks[0] if ranks else {}
        for part in restored:
            if not part.per_rank:
                continue
            if mine is not None:
                _restore(part, mine.get(part.name), source)
            elif part.on_resize == "rank0":
                _restore(part, first.get(part.name), source)
        unused = sorted(
            {k for k, v in shared.items() if _holds_state(v) and k not in self._parts} - unused_ok
        ) + sorted({k for k, v in first.items() if _holds_state(v) and k not in self._parts})
        if unused:
            logger.info("{}: {} not used (this run has no such part)", source, unused)


def _holds_state(value: Any) -> bool:
    """Not None and not an empty list or dict (what a run without the part writes)."""
    return value is not None and not (isinstance(value, (list, tuple, dict)) and not value)


def restore_shards(part: Part, state: Any, source: str) -> None:
    """Give a sharded part the state DCP filled (None: what ``part.missing`` says); a state it
    cannot take is a CheckpointError naming the part and ``source``."""
    if part.load_shards is None:
        raise CheckpointError(f"the checkpoint part {part.name!r} is not sharded.")
    _restore(part, state, source, part.load_shards)


def _restore(
    part: Part, state: Any, source: str, load: Callable[[Any, str], Any] | None = None
) -> None:
    if state is None:
        if part.missing == "error":
            raise CheckpointError(
                f"{source} has no {part.name!r} state; it was not written by this kind of run."
            )
        if part.missing == "warn":
            logger.warning(
                "{} has no {} state; this run's {} starts fresh", source, part.name, part.name
            )
        return
    try:
        if load is None and not part.collective:
            check_like(state, _current(part), f"the {part.name!r} state of {source}")
        (load or part.load)(state, source)
    except CheckpointError:
        raise
    except (KeyError, ValueError, RuntimeError, TypeError) as error:
        raise CheckpointError(
            f"cannot load the {part.name} state from {source}: {error}. Build the {part.name} "
            f"the same way as the run that wrote it."
        ) from error


def _current(part: Part) -> Any:
    """The part's state now, to compare a saved one with (None where it cannot say: the
    part's own load then checks what it can)."""
    try:
        return part.save()
    except Exception:  # a part not ready to save yet (nothing built): nothing to compare
        return None


def check_like(saved: Any, expected: Any, where: str, path: str = "") -> None:
    """Every tensor of ``saved`` with the dtype and shape of the tensor at the same place of
    ``expected`` (this run's state of the part), where that has one: a CheckpointError naming
    the entry otherwise (a load_state_dict would cast or copy it silently)."""
    if isinstance(saved, torch.Tensor) and isinstance(expected, torch.Tensor):
        if saved.dtype != expected.dtype or tuple(saved.shape) != tuple(expected.shape):
            raise CheckpointError(
                f"{where}: {path or 'the value'} is {describe_tensor(saved)} there and "
                f"{describe_tensor(expected)} in this run: it was written by another model or "
                f"configuration (or altered). Build them the same way as the run that wrote it."
            )
        return
    if isinstance(saved, Mapping) and isinstance(expected, Mapping):
        for key, value in saved.items():
            if key in expected:
                check_like(value, expected[key], where, f"{path}[{key!r}]")
    elif isinstance(saved, (list, tuple)) and isinstance(expected, (list, tuple)):
        for index, (value, other) in enumerate(zip(saved, expected, strict=False)):
            check_like(value, other, where, f"{path}[{index}]")


def describe_tensor(tensor: torch.Tensor) -> str:
    """``float32 of shape (3, 4)``: a tensor's dtype and shape, for an error message."""
    return f"{str(tensor.dtype).removeprefix('torch.')} of shape {tuple(tensor.shape)}"


__all__ = [
    "check_like",
    "describe_tensor",
    "Missing",
    "Part",
    "StateRegistry",
    "tracked_part",
    "Stateful",
    "part_of",
    "restore_shards",
]
