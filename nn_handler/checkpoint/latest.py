"""Resuming from the newest checkpoint of a folder that every rank can trust."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.sharded import is_sharded, verify_sharded
from nn_handler.checkpoint.source import Opened
from nn_handler.checkpoint.store.urls import is_checkpoint_url, open_url
from nn_handler.config.checkpoint import CheckpointConfig, is_url
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import CheckpointError


def open_latest(
    manager: CheckpointManager, comm: Communicator, device: torch.device, missing_ok: bool
) -> Opened | None:
    """The newest complete, verified checkpoint in ``manager``'s folder, read on every rank
    (a sharded one's files checked, each rank its share): rank 0 picks the newest readable
    one; a damaged one is skipped with a warning saying why, and the previous one is tried.
    None when there is none and ``missing_ok``. Every rank must call this."""
    skipped: list[Path] = []
    while True:
        opened = _pick(manager, comm, device, skipped)
        if opened is None:
            if missing_ok:
                return None
            raise CheckpointError(f"no complete checkpoint in {manager.where} to resume from.")
        if opened.folder is None or opened.verified:
            return opened
        try:
            verify_sharded(opened.folder, comm, opened.contents)
        except CheckpointError as error:
            if comm.rank == 0:
                logger.warning("{}; trying the previous checkpoint", error)
            skipped.append(opened.path)
            continue
        return opened


def open_for_resume(
    path: str | Path,
    missing_ok: bool,
    comm: Communicator,
    device: torch.device,
    config: CheckpointConfig,
    run_manager: Callable[[], CheckpointManager],
    sharded: bool,
) -> tuple[Opened | None, bool]:
    """The one place that decides what a resume's ``path`` is: 'latest' (``run_manager()``'s
    folder) or a folder of checkpoints (a URL: one on an object store), whose newest verified
    checkpoint is chosen automatically (True); else one checkpoint, a file or a sharded
    folder (a URL: a committed one). Every rank must call this."""
    options = config.storage_options
    if str(path) == "latest":
        manager = run_manager()
    elif (Path(path).is_dir() and not is_sharded(path)) or (
        is_url(path) and not _names_one_checkpoint(str(path), config, comm)
    ):
        own = str(path) == config.dir  # this run's folder: its own working copy
        folder = CheckpointConfig(
            dir=str(path),
            storage_options=options,
            staging_dir=config.staging_dir if own else None,
            store_timeout_s=config.store_timeout_s,
        )
        manager = CheckpointManager(folder, comm, clean=False, sharded=sharded)
    else:
        opened, problem = None, None
        try:
            opened = open_url(path, device, options, config.store_timeout_s)
        except Exception as error:
            problem = error
        agree_on(comm, problem, f"loading checkpoint {path}")
        return opened, False
    return open_latest(manager, comm, device, missing_ok), True


def open_in_one_process(
    path: str | Path,
    device: torch.device | str = "cpu",
    storage_options: Mapping[str, Any] | None = None,
) -> Opened:
    """The checkpoint ``path`` names, read in this process alone (``NNHandler.load``,
    ``nn-handler checkpoint inspect``): a local folder of checkpoints (not itself a sharded
    one) gives its newest complete, verified checkpoint, as a resume would choose it (as an
    object store's folder does); anything else is opened as it is (``open_url``)."""
    if is_url(path) or not Path(path).is_dir() or is_sharded(path):
        return open_url(path, device, storage_options)
    comm = NullCommunicator()
    manager = CheckpointManager(CheckpointConfig(dir=str(path)), comm, clean=False)
    opened = open_latest(manager, comm, torch.device(device), missing_ok=False)
    if opened is None:  # (missing_ok=False raises first)
        raise CheckpointError(f"no complete checkpoint in {path}.")
    return opened


def _names_one_checkpoint(url: str, config: CheckpointConfig, comm: Communicator) -> bool:
    """Whether ``url`` is one committed checkpoint (else a folder of them), as rank 0 reads
    it on the store; every rank gets its answer or its error. Every rank must call this."""
    answer: bool | None = None
    problem: BaseException | None = None
    if comm.rank == 0:
        try:
            answer = is_checkpoint_url(url, config.storage_options, config.store_timeout_s)
        except Exception as error:
            problem = error
    agree_on(comm, problem, f"reading {url}")
    return bool(comm.broadcast_object(answer) if comm.world_size > 1 else answer)


def _pick(
    manager: CheckpointManager, comm: Communicator, device: torch.device, skipped: list[Path]
) -> Opened | None:
    """Rank 0 picks the newest readable checkpoint not in ``skipped``; every rank reads that
    one (the same CheckpointError on every rank if one cannot)."""
    opened: Opened | None = None
    problem: BaseException | None = None
    if comm.rank == 0:
        try:
            opened = manager.load_latest(device, skip=skipped)
        except Exception as error:
            problem = error
    if comm.world_size > 1:
        name = comm.broadcast_object(None if opened is None else opened.path.name)
        if name is not None and comm.rank != 0:
            try:
                opened = manager.open(manager.dir / name, device)
            except Exception as error:
                problem = error
    agree_on(comm, problem, f"loading the latest checkpoint in {manager.where}")
    return opened


__all__ = ["open_for_resume", "open_in_one_process", "open_latest"]
