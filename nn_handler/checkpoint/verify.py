"""The one verifier: a checkpoint's objects against its manifest (checkpoint/manifest.py).

``check_object`` checks a local file (its size, then the CRC-32 of the whole and of each
segment, memory-mapped); ``check_arrived`` checks an object's bytes as they were downloaded
(their size and CRC-32, computed on the way: never read back). ``verify_files`` checks a
sharded folder, each rank a share of its files; a folder without a manifest (written before
checksums) gets structural checks only: its index reads safely and every file it names is
there and long enough. Every failure is a CheckpointError naming the checkpoint, the object,
the bytes and what they hold. (A single file written by ``torch.save`` carries its records'
CRC-32s in its zip directory instead: checkpoint/integrity.py.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from nn_handler.checkpoint.checksum import Crc32, file_crc32, mapped, span_crc32
from nn_handler.checkpoint.manifest import MANIFEST, Entry, read_manifest
from nn_handler.errors import CheckpointError

_EARLIER = "use an earlier checkpoint."
_CHANGED = "Its bytes changed after it was written (a disk or copy error); " + _EARLIER


def check_object(path: Path, entry: Entry, checkpoint: str, key: str) -> None:
    """The local file ``path`` (the object ``key`` of ``checkpoint``) matches ``entry``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {checkpoint} is incomplete: {key} is missing (its manifest lists it); "
            f"{_EARLIER}"
        ) from None
    if size != entry["size"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: {key} has {size} bytes, {entry['size']} were "
            f"written (truncated or replaced); {_EARLIER}"
        )
    if "crc32" in entry:
        actual = file_crc32(path)
        if actual != entry["crc32"]:
            raise CheckpointError(
                f"checkpoint {checkpoint} is corrupt: {key} has CRC-32 {actual:08x}, "
                f"{entry['crc32']:08x} was written. {_CHANGED}"
            )
    if not entry.get("segments"):
        return
    with open(path, "rb") as handle, mapped(handle.fileno(), size) as view:
        for offset, length, stored, label in entry["segments"]:
            actual = span_crc32(view, offset, length)
            if actual != stored:
                what = f" ({label})" if label else ""
                raise CheckpointError(
                    f"checkpoint {checkpoint} is corrupt: {key} bytes {offset}-"
                    f"{offset + length}{what} have CRC-32 {actual:08x}, {stored:08x} was "
                    f"written. {_CHANGED}"
                )


def matches(path: Path, entry: Entry) -> bool:
    """Whether the local file ``path`` already holds the object of ``entry`` (a download of
    it can be skipped)."""
    try:
        check_object(path, entry, "", "")
    except CheckpointError:
        return False
    return True


def check_arrived(arrived: Crc32, entry: Entry, checkpoint: str, key: str) -> None:
    """The bytes of the object ``key`` as they arrived match its ``entry``."""
    if arrived.size != entry["size"] or arrived.value != entry.get("crc32", arrived.value):
        raise CheckpointError(
            f"checkpoint {checkpoint} is corrupt: the object {key} has {arrived.size} bytes "
            f"with CRC-32 {arrived.value:08x}, its manifest records {entry['size']} bytes with "
            f"{entry.get('crc32', 0):08x}. Its bytes changed after it was written; {_EARLIER}"
        )


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

    manifest = read_manifest(folder)
    if manifest is None:
        if required:
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: its {MANIFEST} (the checksums of its "
                f"files) is missing; {_EARLIER}"
            )
        _check_structure(folder)
        return
    files = manifest.files()
    if INDEX not in files:
        raise CheckpointError(f"checkpoint {folder}: its {MANIFEST} does not list {INDEX}.")
    mine = share(files, rank, world)
    verify_files_named(folder, files, mine)
    if INDEX in mine:  # a forged index with a forged manifest still never loads
        read_index(folder / INDEX)


def verify_files_named(folder: Path, files: dict[str, Entry], names: list[str]) -> None:
    """Check the files ``names`` of ``folder`` against the manifest's ``files``."""
    for name in names:
        check_object(folder / name, files[name], str(folder), name)


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
                f"{_EARLIER}"
            ) from None
        if size < end:
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {name} has {size} bytes, its index needs "
                f"{end} (truncated); {_EARLIER}"
            )


__all__ = [
    "check_arrived",
    "check_object",
    "matches",
    "share",
    "verify_files",
    "verify_files_named",
]
