"""A checkpoint named by its URL on an object store, outside a run's folder: whether a URL names
one committed checkpoint (``is_checkpoint_url``), the store of a folder there
(``folder_store``), and the store a single file saved there is committed by (``store_of``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.manifest import manifest_name
from nn_handler.checkpoint.store.object_store import ObjectStore
from nn_handler.checkpoint.store.remote_store import DEFAULT_TIMEOUT_S, RemoteStore
from nn_handler.config.checkpoint import CheckpointConfig
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


def folder_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ObjectStore:
    """The ObjectStore of the folder ``url`` (not started: to read, or to save a file into);
    release it after."""
    options = dict(storage_options) if storage_options is not None else None
    config = CheckpointConfig(
        dir=url, storage_options=options, staging_dir=staging_dir, store_timeout_s=timeout_s
    )
    return ObjectStore(config)


def store_of(
    url: str, storage_options: Mapping[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[ObjectStore, Path]:
    """The ObjectStore of the folder holding the checkpoint ``url``, and where that
    checkpoint goes in its working copy (a save to a URL is committed there as every
    checkpoint is); release the store after."""
    parent, name = split_url(url)
    if "://" not in parent or parent.endswith(":/") or not name:
        raise CheckpointError(f"{url} names no checkpoint inside a folder (s3://bucket/run/x.pt).")
    store = folder_store(parent, storage_options, None, timeout_s)
    return store, store.dir / name


__all__ = ["folder_store", "is_checkpoint_url", "split_url", "store_of"]
