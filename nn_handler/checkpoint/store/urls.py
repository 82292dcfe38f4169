"""A checkpoint named by its URL on an object store, outside a run's folder: reading the one at
a URL (``fetch_url``, ``open_url``: a committed checkpoint, or the latest of a folder of them)
and the store a single file saved there is committed by (``store_of``), both through the
folder's ObjectStore."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.manifest import SUFFIX, manifest_name
from nn_handler.checkpoint.source import Opened, open_checkpoint
from nn_handler.checkpoint.store.object_store import ObjectStore
from nn_handler.checkpoint.store.remote_store import DEFAULT_TIMEOUT_S, RemoteStore
from nn_handler.config.checkpoint import CheckpointConfig, is_url
from nn_handler.errors import CheckpointError


def split_url(url: str) -> tuple[str, str]:
    """(the folder, the name) of a checkpoint's URL."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def is_checkpoint_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Whether ``url`` names one committed checkpoint (not a folder of them)."""
    parent, name = split_url(url)
    if "://" not in parent or parent.endswith(":/"):
        return False  # s3://bucket: a bucket is never a checkpoint
    store = RemoteStore(parent, storage_options, timeout_s=timeout_s)
    return store.read(manifest_name(name)) is not None


def _store(
    url: str, storage_options: Mapping[str, Any] | None, staging_dir: str | None, timeout_s: float
) -> ObjectStore:
    options = dict(storage_options) if storage_options is not None else None
    config = CheckpointConfig(
        dir=url, storage_options=options, staging_dir=staging_dir, store_timeout_s=timeout_s
    )
    return ObjectStore(config)


def fetch_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Path, str]:
    """The checkpoint at ``url`` (a committed checkpoint, or a folder of them: the one its
    ``latest.json`` names) in a local working copy, every object checked against its
    manifest, and that checkpoint's URL. Raises CheckpointError when there is none or it
    does not match."""
    if is_checkpoint_url(url, storage_options, timeout_s):
        parent, name = split_url(url)
        store = _store(parent, storage_options, staging_dir, timeout_s)
        try:
            return store.fetch(name), url.rstrip("/")
        finally:
            store.release()
    store = _store(url, storage_options, staging_dir, timeout_s)
    try:
        pointer = store.read_latest()
        latest = pointer.get("checkpoint") if isinstance(pointer, dict) else None
        if not isinstance(latest, str):
            raise CheckpointError(
                f"no committed checkpoint at {url} (neither <name>{SUFFIX} beside it nor a "
                f"latest.json under it)."
            )
        return store.fetch(latest), store.store.url_of(latest)
    finally:
        store.release()


def open_url(
    path: str | Path,
    map_location: torch.device | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Opened:
    """Read the checkpoint at ``path``: a local one, or at a URL one committed on an object
    store or the latest of a folder there, downloaded and checked first (see
    ``fetch_url``)."""
    if not is_url(path):
        return open_checkpoint(path, map_location)
    local, url = fetch_url(str(path), storage_options, timeout_s=timeout_s)
    return open_checkpoint(local, map_location, where=url, verified=True)


def store_of(
    url: str, storage_options: Mapping[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[ObjectStore, Path]:
    """The ObjectStore of the folder holding the checkpoint ``url``, and where that
    checkpoint goes in its working copy (a save to a URL is committed there as every
    checkpoint is); release the store after."""
    parent, name = split_url(url)
    if "://" not in parent or parent.endswith(":/") or not name:
        raise CheckpointError(f"{url} names no checkpoint inside a folder (s3://bucket/run/x.pt).")
    store = _store(parent, storage_options, None, timeout_s)
    return store, store.dir / name


__all__ = ["fetch_url", "is_checkpoint_url", "open_url", "split_url", "store_of"]
