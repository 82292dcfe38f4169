"""The Trainer's checkpoint format (docs/checkpoints.md, "What a checkpoint holds"): the marker
and version, the run configuration as plain values, the check that a loaded object is a
training checkpoint, a rank's saved parts, and the rules on a world-size change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from nn_handler.checkpoint.format import META, SHARDED
from nn_handler.checkpoint.naming import order
from nn_handler.checkpoint.run_identity import RUN, field_differences
from nn_handler.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from nn_handler.distributed.communicator import Communicator

FORMAT = "nn_handler.checkpoint"
VERSION = 1


def plain_config(config: BaseModel) -> dict[str, Any]:
    """A config as JSON-compatible values for a checkpoint; values JSON cannot hold (a callable
    in compile_kwargs, say) are stored as their repr."""
    try:
        return dict(config.model_dump(mode="json"))
    except Exception:  # pydantic's serialisation error for values it cannot convert
        dumped = config.model_dump()
        return json.loads(json.dumps(dumped, default=repr))  # type: ignore[no-any-return]


def assemble(
    shared: Mapping[str, Any],
    ranks: list[Any],
    world_size: int,
    run_config: Any,
    run: tuple[str, dict[str, Any]],
    sharded: list[str],
) -> dict[str, Any]:
    """A training checkpoint's top level: the ``shared`` parts, every rank's parts, the run
    (its id and fingerprint) and, for a sharded checkpoint, the parts in its shards."""
    checkpoint = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        **shared,
        "config": run_config,
        "ranks": ranks,
        RUN: {"id": run[0], "fingerprint": run[1]},
    }
    if sharded:
        checkpoint[SHARDED] = list(sharded)
    return checkpoint


def parts_of(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any], list[str]]:
    """(the shared parts, every rank's parts, the parts in the shards) of a checked training
    checkpoint (``check_checkpoint``)."""
    shared = {k: v for k, v in checkpoint.items() if k not in META}
    ranks = [rank_parts(r) for r in checkpoint["ranks"]]
    return shared, ranks, [str(name) for name in checkpoint.get(SHARDED) or []]


def check_checkpoint(checkpoint: Any, source: str) -> dict[str, Any]:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        keys = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint)
        raise CheckpointError(
            f"{source} is not an nn_handler training checkpoint (top level: {keys}). To load "
            f"bare weights use nn_handler.checkpoint.load_model_state(model, state) or "
            f"NNHandler.load."
        )
    if int(checkpoint.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{source} was written by a newer nn_handler (format version "
            f"{checkpoint['version']} > {VERSION}); upgrade nn_handler to load it."
        )
    return checkpoint


def rank_parts(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's saved parts; the tracked states of the first writers (nested under
    ``tracked``) read as ``tracked.<name>``."""
    parts = {k: v for k, v in saved.items() if k != "tracked"}
    for name, state in (saved.get("tracked") or {}).items():
        parts[f"tracked.{name}"] = state
    return parts


def check_world_change(source: str, saved_world: int, world: int, allowed: bool) -> None:
    if allowed:
        return
    raise CheckpointError(
        f"{source} was written by {saved_world} rank(s); this run has {world}. Resume with "
        f"{saved_world} rank(s) to continue exactly, or set "
        f"checkpoint.allow_world_size_change=True (or pass allow_world_size_change=True) to "
        f"continue with the data re-sharded over the new ranks (a different data order from "
        f"then on; mid-epoch, the rest of the epoch visits each remaining sample once)."
    )


def _reproducible_of(run_config: Any) -> dict[str, Any] | None:
    """The reproducible mode's settings in a checkpoint's run configuration (NNHandler's
    whole config under ``handler``, or a Trainer's sections); None: off."""
    config = run_config.get("handler", run_config) if isinstance(run_config, Mapping) else {}
    trainer = config.get("trainer") if isinstance(config, Mapping) else None
    mode = trainer.get("reproducible") if isinstance(trainer, Mapping) else None
    return dict(mode) if isinstance(mode, Mapping) else None


def check_reproducible(saved_config: Any, run_config: Any, source: str) -> None:
    """A ConfigError naming the fields unless the checkpoint was written in the reproducible
    mode with the same batch sizes and seed (even with resume: force: nothing else continues
    it exactly)."""
    saved, now = _reproducible_of(saved_config), _reproducible_of(run_config)
    if saved_config is None or saved == now:
        return
    if saved is None or now is None:
        what = "without" if saved is None else "with"
        fields = (
            f"it was written {what} trainer.reproducible, this run has it {'on' if now else 'off'}"
        )
    else:
        where = ("in the checkpoint", "in this run")
        fields = "; ".join(field_differences(saved, now, where, "trainer.reproducible."))
    raise ConfigError(
        f"cannot resume {source} in the reproducible mode: {fields}. The steps would be cut "
        f"otherwise (samples of the epoch skipped or trained twice) and the run would leave "
        f"the bit-identical path; resume with the checkpoint's settings, or start afresh."
    )


def refuse_a_shorter_latest(comm: Communicator, existing: list[Path], folder: str) -> None:
    """A ConfigError on every rank when a fresh ``resume: on_restart`` start meets committed
    checkpoints (``existing``, rank 0's listing): this shorter run would become the latest.
    Every rank must call this."""
    newest = max(existing, key=order).name if existing else None
    if comm.world_size > 1:
        newest = comm.broadcast_object(newest)
    if newest is None:
        return
    raise ConfigError(
        f"checkpoint.dir {folder} already holds committed checkpoints (the newest: {newest}) "
        f"and this run starts afresh (resume: on_restart, and this is not a restart): it would "
        f"become the latest over them. Set resume: auto to continue that run, or resume: never "
        f"to start a new one over it (its checkpoints are kept), or use another folder."
    )


def world_change_note(
    source: str, saved_world: int, world: int, batches_done: int, allowed: bool, exact: bool
) -> str:
    """What a resume at another world size says (after ``check_world_change``, skipped for
    the reproducible mode: ``exact``, whose steps are the same at any world size)."""
    if exact:
        return (
            f"resuming {source} (written by {saved_world} ranks) with {world} ranks: the "
            f"reproducible mode's steps do not depend on the world size, so the run continues "
            f"bit-identical to an uninterrupted one"
        )
    check_world_change(source, saved_world, world, allowed)
    rest = " (the rest of the interrupted epoch visits each of its remaining samples once)"
    return (
        f"resuming {source} (written by {saved_world} ranks) with {world} ranks: the data is "
        f"re-sharded, so the order differs from an uninterrupted run from here on"
        f"{rest if batches_done else ''}"
    )


__all__ = [
    "FORMAT",
    "VERSION",
    "assemble",
    "parts_of",
    "check_checkpoint",
    "check_reproducible",
    "check_world_change",
    "plain_config",
    "world_change_note",
    "rank_parts",
    "refuse_a_shorter_latest",
]
