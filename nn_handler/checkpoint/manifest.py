"""Checksums of sharded checkpoints: ``manifest.json``, written last into the staging folder.

(The writer that computes the checksums is checkpoint/checksumming_writer.py, which imports
DCP; this module does not.) DCP stores no checksum, so a flipped bit in a ``__*.distcp`` shard
would load silently. Each
rank checksums what it has just written, item by item (the CRC-32 of every tensor's or value's
bytes, read back from its file), and hands the sums to rank 0 inside the write results DCP
gathers anyway (no collective of ours). Rank 0 writes DCP's plain index and then the manifest:
for every file of the folder its size and segments (offset, length, CRC-32, what they hold).
Stock DCP ignores the extra file, so a folder still loads with plain ``dcp.load``.

``verify_files`` checks a folder against its manifest (each rank a share of the files); a
folder without a manifest (written before checksums) gets structural checks only: its index
reads safely and every file it names is there and long enough.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.checksum import mapped, span_crc32
from nn_handler.checkpoint.io import atomic_write_json
from nn_handler.errors import CheckpointError

MANIFEST = "manifest.json"

_FORMAT = "nn_handler.manifest"
_VERSION = 1


def write_manifest(folder: Path, shards: dict[str, dict[str, Any]]) -> Path:
    """Write ``folder/manifest.json``: ``shards`` (each shard file's size and segments) and a
    whole-file CRC-32 of every other file already in the folder (the index, trainer.pt)."""
    files = {name: shards[name] for name in sorted(shards)}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in files and path.name != MANIFEST:
            size = path.stat().st_size
            with open(path, "rb") as handle, mapped(handle.fileno(), size) as view:
                files[path.name] = {
                    "size": size,
                    "segments": [[0, size, span_crc32(view, 0, size), ""]],
                }
    for entry in files.values():
        entry["segments"].sort()
    manifest = {"format": _FORMAT, "version": _VERSION, "files": files}
    return atomic_write_json(manifest, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The files of ``folder``'s manifest (None when it has none); CheckpointError when the
    manifest is unreadable."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: its {MANIFEST} is unreadable ({type(error).__name__}: "
            f"{error}); use an earlier checkpoint."
        ) from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not an nn_handler manifest.")
    if int(manifest.get("version", 0)) > _VERSION:
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST} has format version {manifest['version']}; "
            f"upgrade nn_handler to verify it."
        )
    return files


def share(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: the index and the small files on rank 0,
    the shard files round-robin (each rank about one file when the world wrote them)."""
    names = sorted(names)
    small = [n for n in names if not n.endswith(".distcp")]
    shards = [n for n in names if n.endswith(".distcp")]
    mine = [n for i, n in enumerate(shards) if i % world == rank]
    return (small if rank == 0 else []) + mine


def verify_files(folder: Path, rank: int = 0, world: int = 1, required: bool = False) -> None:
    """Check this rank's share of ``folder``'s files against its manifest (every file with
    ``world == 1``; the index, also read without running code, on rank 0); raises
    CheckpointError naming the file, the bytes and what they hold.
    A folder without a manifest is an error when ``required`` (it was written with one), and
    gets structural checks otherwise (see the module docstring)."""
    from nn_handler.checkpoint.safe_dcp import INDEX, read_index  # imports DCP

    files = read_manifest(folder)
    if files is None:
        if required:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: its {MANIFEST} (the checksums of its "
                f"files) is missing; use an earlier checkpoint."
            )
        _check_structure(folder)
        return
    if INDEX not in files:
        raise CheckpointError(f"checkpoint {folder}: its {MANIFEST} does not list {INDEX}.")
    mine = share(files, rank, world)
    verify_files_named(folder, files, mine)
    if INDEX in mine:  # a forged index with a forged manifest still never loads
        read_index(folder / INDEX)


def verify_files_named(folder: Path, files: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Check the files ``names`` of ``folder`` against the manifest's ``files``."""
    for name in names:
        _verify_file(folder, name, files[name])


def _verify_file(folder: Path, name: str, entry: dict[str, Any]) -> None:
    path = folder / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {folder} is incomplete: {name} is missing (its {MANIFEST} lists it); "
            f"use an earlier checkpoint."
        ) from None
    if size != int(entry["size"]):
        raise CheckpointError(
            f"checkpoint {folder} is damaged: {name} has {size} bytes, {entry['size']} were "
            f"written (truncated or replaced); use an earlier checkpoint."
        )
    with open(path, "rb") as handle, mapped(handle.fileno(), size) as view:
        for offset, length, stored, label in entry["segments"]:
            actual = span_crc32(view, int(offset), int(length))
            if actual != int(stored):
                what = f" ({label})" if label else ""
                raise CheckpointError(
                    f"checkpoint {folder} is corrupt: {name} bytes {offset}-{offset + length}"
                    f"{what} have CRC-32 {actual:08x}, {stored:08x} was written. Its bytes "
                    f"changed after it was written (a disk or copy error); use an earlier "
                    f"checkpoint."
                )


def _check_structure(folder: Path) -> None:
    """A folder without checksums: its index reads safely, and every file it names exists and
    is long enough for the items in it."""
    from nn_handler.checkpoint.safe_dcp import INDEX, read_index

    metadata = read_index(folder / INDEX)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: {name} is missing (its index names it); "
                f"use an earlier checkpoint."
            ) from None
        if size < end:
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {name} has {size} bytes, its index needs "
                f"{end} (truncated); use an earlier checkpoint."
            )


__all__ = [
    "MANIFEST",
    "read_manifest",
    "share",
    "verify_files",
    "verify_files_named",
    "write_manifest",
]
