"""Opening a checkpoint: the one way in for every reader. What a path holds is decided once
(format.py ``kind_of``); a folder of checkpoints, local or on an object store, gives its newest
complete, verified one (a damaged one is skipped with a warning); a URL's checkpoint is
downloaded and checked as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from loguru import logger

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.format import is_sharded, kind_of, top_file
from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.manifest import SUFFIX
from nn_handler.checkpoint.naming import PERIODIC, order
from nn_handler.checkpoint.sharded import verify_sharded
from nn_handler.checkpoint.store import CheckpointStore, LocalStore, location
from nn_handler.checkpoint.store.remote_store import DEFAULT_TIMEOUT_S
from nn_handler.checkpoint.store.urls import folder_store, is_checkpoint_url, split_url
from nn_handler.config.checkpoint import CheckpointConfig, is_url
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import CheckpointError

if TYPE_CHECKING:
    from nn_handler.checkpoint.manager import CheckpointManager

    MapLocation = torch.device | str | None


class Opened(NamedTuple):
    """A checkpoint read from disk: its local ``path``, its ``contents`` (a file's whole
    checkpoint or a folder's ``trainer.pt``), the sharded ``folder`` (None for a file), where
    the user names it (``where``: a URL for an object store) and whether every byte was
    ``verified`` as it was fetched."""

    path: Path
    contents: Any
    folder: Path | None
    where: str
    verified: bool = False


def read(
    path: str | Path,
    map_location: MapLocation = None,
    *,
    store: CheckpointStore | None = None,
    where: str = "",
    glance: bool = False,
) -> Opened:
    """The checkpoint ``path`` (with ``store``: fetched from it), read weights-only and checked
    (``glance``: memory-mapped and unchecked, to look at it). Raises CheckpointError."""
    target, named, verified = Path(path), str(path), False
    if store is not None:
        target = store.fetch(target.name)
        named, verified = location(where, target), is_url(where)
    check = not (verified or glance)
    contents = load_file(top_file(target), map_location, mmap=glance, verify=check)
    return Opened(target, contents, target if is_sharded(target) else None, named, verified)


def open_checkpoint(
    path: str | Path,
    map_location: MapLocation = "cpu",
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    staging_dir: str | None = None,
    glance: bool = False,
) -> Opened:
    """The checkpoint ``path`` names (a file, a folder, a folder of checkpoints' newest, a
    URL), read in this process alone; ``staging_dir``: where a URL's is downloaded."""
    kind = kind_of(path)
    if kind in ("file", "folder"):
        return read(path, map_location, glance=glance)
    url = str(path).rstrip("/")
    if kind == "url" and is_checkpoint_url(url, storage_options, timeout_s):
        parent, name = split_url(url)
        one = folder_store(parent, storage_options, staging_dir, timeout_s)
        return read(name, map_location, store=one, where=parent, glance=glance)
    local = kind == "checkpoints"
    store: CheckpointStore = (
        LocalStore(Path(path))
        if local
        else folder_store(url, storage_options, staging_dir, timeout_s)
    )
    where = str(Path(path)) if local else url
    found = _newest(store, where, NullCommunicator(), map_location, missing_ok=True)
    if found is None and local:
        raise CheckpointError(f"no complete checkpoint in {where}.")
    if found is None:
        raise CheckpointError(
            f"no committed checkpoint at {url} (neither <name>{SUFFIX} beside it nor a "
            f"committed checkpoint under it)."
        )
    return found


def open_on_every_rank(
    path: str | Path,
    missing_ok: bool,
    comm: Communicator,
    device: torch.device,
    config: CheckpointConfig,
    run_folder: Callable[[], CheckpointManager],
) -> tuple[Opened | None, bool]:
    """What a resume of ``path`` opens, and whether it was chosen automatically: 'latest'
    (``run_folder()``'s) or a folder's newest verified checkpoint (None: none, ``missing_ok``),
    else the one named. Every rank must call this; all raise the same CheckpointError."""
    kind = "latest" if str(path) == "latest" else kind_of(path)
    url = str(path).rstrip("/")
    one = kind in ("file", "folder")
    if kind == "url":
        one = bool(_on_rank_0(comm, f"reading {url}", lambda: _names_one(url, config)))
    if one:
        opened, problem = None, None
        try:
            if kind == "url":
                parent, name = split_url(url)
                opened = read(name, device, store=_folder(parent, config), where=parent)
            else:
                opened = read(path, device)
        except Exception as error:
            problem = error
        agree_on(comm, problem, f"loading checkpoint {path}")
        return opened, False
    if kind == "latest":
        manager = run_folder()
        return _newest(manager.folder, manager.where, comm, device, missing_ok), True
    where = url if kind == "url" else str(Path(path))
    return _newest(_folder(where, config), where, comm, device, missing_ok), True


def _newest(
    store: CheckpointStore, where: str, comm: Communicator, device: MapLocation, missing_ok: bool
) -> Opened | None:
    """The newest complete, verified checkpoint in ``store`` (latest.json's first; a damaged
    one is skipped with a warning), read on every rank. Every rank must call this."""
    skipped: set[Path] = set()
    while True:
        opened: Opened | None = None
        problem: BaseException | None = None
        if comm.rank == 0:
            try:
                listing = store.checkpoints()  # what it holds now
                periodic = [p for p in listing if PERIODIC.match(p.name)]
                pointed = listing.latest
                ordered = sorted(periodic, key=order, reverse=True)
                if pointed is not None:
                    ordered = [pointed] + [p for p in ordered if p != pointed]
                for candidate in (p for p in ordered if p not in skipped):
                    try:
                        opened = read(candidate, device, store=store, where=where)
                        break
                    except CheckpointError as error:
                        logger.warning("{}; trying the previous checkpoint", error)
                        skipped.add(candidate)
            except Exception as error:
                problem = error
        if comm.world_size > 1:
            name = comm.broadcast_object(None if opened is None else opened.path.name)
            if name is not None and comm.rank != 0:
                try:
                    opened = read(name, device, store=store, where=where)
                except Exception as error:
                    problem = error
        agree_on(comm, problem, f"loading the latest checkpoint in {where}")
        if opened is None:
            if missing_ok:
                return None
            raise CheckpointError(f"no complete checkpoint in {where} to resume from.")
        if opened.folder is None or opened.verified:
            return opened
        try:
            verify_sharded(opened.folder, comm, opened.contents)
        except CheckpointError as error:
            if comm.rank == 0:
                logger.warning("{}; trying the previous checkpoint", error)
            skipped.add(opened.path)
            continue
        return opened


def _names_one(url: str, config: CheckpointConfig) -> bool:
    return is_checkpoint_url(url, config.storage_options, config.store_timeout_s)


def _folder(where: str, config: CheckpointConfig) -> CheckpointStore:
    """The store of the folder of checkpoints ``where`` (read only): this run's own folder
    through its own working copy."""
    if kind_of(where) != "url":
        return LocalStore(Path(where))
    own = where.rstrip("/") == str(config.dir).rstrip("/")
    staging = config.staging_dir if own else None
    return folder_store(where, config.storage_options, staging, config.store_timeout_s)


def _on_rank_0(comm: Communicator, what: str, answer: Callable[[], Any]) -> Any:
    """Rank 0's ``answer()``, or its error, on every rank. Every rank must call this."""
    found: Any = None
    problem: BaseException | None = None
    if comm.rank == 0:
        try:
            found = answer()
        except Exception as error:
            problem = error
    agree_on(comm, problem, what)
    return comm.broadcast_object(found) if comm.world_size > 1 else found


__all__ = ["Opened", "open_checkpoint", "open_on_every_rank", "read"]
