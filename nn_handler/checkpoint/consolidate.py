"""One file from a sharded checkpoint: ``nn-handler checkpoint consolidate DIR OUT.pt``.

Reads the folder in one process (no process group) and writes a single-file training
checkpoint holding the whole model, the whole EMA when there is one, and every unsharded part
(history, loop position, schedulers, RNG): weights only, without the optimizers' states, so
``NNHandler.load(OUT.pt, model)`` restores it in one process. The run configuration stored in
it is made loadable in one process: a sharded strategy becomes 'auto', checkpoints 'file'.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.format import CHECKSUMS, SHARDED, kind_of
from nn_handler.checkpoint.opening import read
from nn_handler.checkpoint.run_identity import RUN
from nn_handler.checkpoint.saving import SaveRoute
from nn_handler.checkpoint.sharded import load_shards, verify_sharded
from nn_handler.checkpoint.single_file import FileWriter
from nn_handler.checkpoint.store.local import LocalStore
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import CheckpointError

#: The sharded parts a consolidated file holds whole.
WEIGHTS = ("model", "ema")


def read_whole(folder: str | Path, parts: tuple[str, ...] = WEIGHTS) -> dict[str, Any]:
    """The named parts of a sharded checkpoint, each whole (plain tensors on the CPU), read
    in this process alone without running code from it (verify it first:
    ``verify_sharded``). Parts the folder does not hold are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from nn_handler.checkpoint.safe_dcp import INDEX, read_index

    metadata = read_index(Path(folder) / INDEX)
    paths = metadata.planner_data or {}
    template: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        path = paths.get(fqn, tuple(fqn.split(".", 1)))
        if path[0] not in parts:
            continue
        node = template
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = (
            torch.empty(entry.size, dtype=entry.properties.dtype)
            if isinstance(entry, TensorStorageMetadata)
            else None  # a plain value (a count): DCP puts the saved one in its place
        )
    if template:
        load_shards(folder, template, None)
    return template


def consolidate(folder: str | Path, out: str | Path) -> Path:
    """Write the sharded checkpoint ``folder`` as the single file ``out`` (weights only; see
    the module docstring) and return its path. The folder's files are checked against their
    checksums first; ``out`` may not lie inside the folder (it would replace or add to the
    checkpoint's own files)."""
    source = Path(folder)
    if kind_of(source) != "folder":
        raise CheckpointError(
            f"{source} is not a sharded checkpoint folder (it has no trainer.pt); "
            f"consolidate takes a folder such as ckpt-e0003-s00000120/."
        )
    target = Path(out)
    if target.resolve().parent == source.resolve() or source.resolve() in target.resolve().parents:
        raise CheckpointError(
            f"consolidate would write {target} inside the checkpoint {source} it reads (and "
            f"replace or add to its files); write it elsewhere, e.g. {source.parent / 'model.pt'}."
        )
    rest = dict(read(source, "cpu").contents)
    verify_sharded(source, None, rest)
    rest.pop(CHECKSUMS, None)
    sharded = [str(name) for name in rest.pop(SHARDED, None) or []]
    whole = read_whole(source, tuple(name for name in sharded if name in WEIGHTS))
    rest.update(whole)
    rest["config"] = loadable_in_one_process(rest.get("config") or {})
    left_out = sorted(set(sharded) - set(whole))
    if left_out:
        rest["consolidated_without"] = left_out
    # Saved as any single-file checkpoint is: the one save route, committed by the store.
    run = rest.get(RUN)
    run_id = str(run["id"]) if isinstance(run, dict) and run.get("id") else None
    comm = NullCommunicator()
    target.parent.mkdir(parents=True, exist_ok=True)
    SaveRoute(comm, LocalStore(target.parent)).save(target, FileWriter(comm), rest, run=run_id)
    return target


def loadable_in_one_process(config: Mapping[str, Any]) -> dict[str, Any]:
    """A stored run configuration (``{"handler": ...}``) made loadable in one process: a
    sharded strategy becomes 'auto', checkpoints 'auto' and synchronous."""
    plain = copy.deepcopy(dict(config))
    handler = plain.get("handler")
    if isinstance(handler, dict):
        trainer = handler.get("trainer")
        if isinstance(trainer, dict) and trainer.get("strategy") == "fsdp":
            trainer["strategy"] = "auto"
        checkpoint = handler.get("checkpoint")
        if isinstance(checkpoint, dict):
            checkpoint.update({"format": "auto", "async_save": False})
    return plain


__all__ = ["WEIGHTS", "consolidate", "loadable_in_one_process", "read_whole"]
