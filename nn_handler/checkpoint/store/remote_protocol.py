"""The commit protocol of checkpoints on an object store, where nothing renames atomically: every
object is uploaded, then rank 0 writes the manifest ``<name>.manifest.json`` (one PUT: the
commit), then latest.json. A checkpoint without a readable manifest is never trusted; deleting
removes the manifest first; downloads are checked against it (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nn_handler.checkpoint.manifest import SUFFIX, Entry, Manifest, manifest_name
from nn_handler.checkpoint.store.remote_store import MissingObject, RemoteStore
from nn_handler.checkpoint.verify import Arrival, entry_of, matches
from nn_handler.errors import CheckpointError


def upload(
    store: RemoteStore,
    objects: Mapping[str, Path],
    workers: int,
    known: Mapping[str, Entry] | None = None,
) -> dict[str, Entry]:
    """Upload ``objects`` (key -> local file), ``workers`` at a time; returns each one's
    entry: ``known``'s (checksummed as it was written), else its size and CRC-32 (of the
    local bytes it sent). Raises the first failure as a CheckpointError."""

    def one(key: str, path: Path) -> tuple[str, Entry]:
        entry = (known or {}).get(key) or entry_of(path)
        store.put(path, key)
        return key, entry

    if not objects:
        return {}
    with ThreadPoolExecutor(max(1, min(workers, len(objects))), "nn_handler-put") as pool:
        done = [pool.submit(one, key, path) for key, path in objects.items()]
        return dict(future.result() for future in done)


def commit(store: RemoteStore, manifest: Manifest) -> None:
    """Write ``manifest``: from now on its checkpoint is trusted."""
    store.write(manifest_name(manifest.name), manifest.to_bytes())


def read_manifests(
    store: RemoteStore, warn: Callable[[str], None] | None = None
) -> tuple[dict[str, Manifest], dict[str, int]]:
    """Every committed checkpoint of the folder (a manifest that cannot be read is skipped,
    with ``warn``), and the folder's listing (key -> size)."""
    listing = store.listing()
    found: dict[str, Manifest] = {}
    for key in sorted(listing):
        if "/" in key or not key.endswith(SUFFIX):
            continue
        name = key[: -len(SUFFIX)]
        data = store.read(key)
        if data is None:  # deleted since the listing
            continue
        try:
            manifest = Manifest.from_bytes(data, store.url_of(key))
            vouches_for(manifest, name, store.url_of(key))
        except CheckpointError as error:
            if warn is not None:
                warn(f"{error}; its checkpoint is not trusted, and its objects are kept")
            continue
        found[name] = manifest
    return found, listing


def vouches_for(manifest: Manifest, name: str, where: str) -> None:
    """Refuse (CheckpointError) a manifest that names another checkpoint (copied or renamed
    by hand): only a checkpoint's own manifest may decide which objects are leftovers."""
    if manifest.name != name:
        raise CheckpointError(f"{where} describes {manifest.name!r}, not {name!r}")


def incomplete(
    listing: Mapping[str, int],
    committed: Mapping[str, Manifest],
    is_checkpoint: Callable[[str], bool],
) -> list[str]:
    """Objects of checkpoints with no manifest (a killed upload), or that their readable
    manifest does not list; a manifest that exists but could not be read keeps every object."""
    listed = {key for manifest in committed.values() for key in manifest.objects}
    manifested = {key[: -len(SUFFIX)] for key in listing if "/" not in key and key.endswith(SUFFIX)}
    unread = manifested - committed.keys()
    stale = []
    for key in sorted(listing):
        top = key.split("/", 1)[0]
        if key.endswith(SUFFIX) or not is_checkpoint(top) or key in listed or top in unread:
            continue
        stale.append(key)
    return stale


def remove(store: RemoteStore, manifest: Manifest) -> None:
    """Delete a checkpoint: its manifest first (it is no longer trusted), then its objects."""
    store.remove(manifest_name(manifest.name))
    for key in manifest.objects:
        store.remove(key)


def copy(store: RemoteStore, source: Manifest, target: str) -> Manifest:
    """Make ``target`` a committed copy of the checkpoint ``source`` (the objects copied by
    the store, then the new manifest); an older ``target`` is deleted first."""
    old = store.read(manifest_name(target))
    if old is not None:
        remove(store, Manifest.from_bytes(old, store.url_of(manifest_name(target))))
    objects: dict[str, Entry] = {}
    for key, entry in source.objects.items():
        renamed = target + key[len(source.name) :]
        store.copy(key, renamed)
        objects[renamed] = entry
    copied = Manifest(target, objects, source.run)
    commit(store, copied)
    return copied


def fetch(store: RemoteStore, manifest: Manifest, local_root: Path, workers: int) -> Path:
    """The checkpoint of ``manifest`` in ``local_root``: every object already there with the
    manifest's size and CRC-32 is kept, the others are downloaded and checked. Raises
    CheckpointError naming the object that is missing or whose bytes changed."""

    def one(key: str, entry: Entry) -> None:
        path = local_root / key
        if matches(path, entry):
            return
        partial = path.with_name(f".{path.name}.tmp-fetch-{os.getpid()}")
        where = store.url_of(manifest.name)
        try:
            arrival = Arrival(entry, where, key)
            try:
                store.get(key, partial, arrival.update)
            except MissingObject:
                raise CheckpointError(
                    f"checkpoint {where} is incomplete: the object {key} is missing (its "
                    f"manifest lists it); use an earlier checkpoint."
                ) from None
            arrival.check()
            os.replace(partial, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    local_root.mkdir(parents=True, exist_ok=True)
    if not manifest.objects:
        raise CheckpointError(f"checkpoint {store.url_of(manifest.name)} lists no objects.")
    with ThreadPoolExecutor(max(1, min(workers, len(manifest.objects))), "nn_handler-get") as pool:
        for future in [pool.submit(one, k, e) for k, e in sorted(manifest.objects.items())]:
            future.result()
    return local_root / manifest.name


__all__ = [
    "commit",
    "copy",
    "fetch",
    "incomplete",
    "read_manifests",
    "remove",
    "upload",
    "vouches_for",
]
