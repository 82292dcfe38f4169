"""The one verifier: the only code that computes a checkpoint's checksums (with checksum.py's
helpers) and compares them with the ones recorded: a local file (``check_object``), a download
as it arrives (``Arrival``), a sharded folder (``verify_files``, each rank a share), a single
file's zip records (``verify_records``). Failures are CheckpointErrors naming the object.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.checksum import Crc32, crc32, file_crc32, mapped, span_crc32
from nn_handler.checkpoint.integrity import BadRecord, data_start, tensors_of
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


def entry_of(path: Path) -> Entry:
    """What a manifest records of the file ``path``: its size and CRC-32."""
    return {"size": path.stat().st_size, "crc32": file_crc32(path)}


def entry_of_bytes(data: bytes | memoryview) -> Entry:
    """What a manifest records of ``data`` (a state sent between live ranks): its size and
    CRC-32."""
    return {"size": len(data), "crc32": crc32(data)}


def item_entries(path: Path, items: list[tuple[int, int, str]]) -> tuple[int, list[Any]]:
    """The size of the file ``path`` and a manifest segment (offset, length, CRC-32, label)
    for each of its ``items`` (offset, length, label): a DCP shard's tensors."""
    size = path.stat().st_size
    with open(path, "rb") as handle, mapped(handle.fileno(), size) as view:
        return size, [[o, n, span_crc32(view, o, n), label] for o, n, label in items]


class Passing(io.RawIOBase):
    """A write stream checksumming what passes to ``raw`` span by span (a span ends at each
    ``tell()``: DCP's writer asks around each item); ``spans``: (offset, length) -> CRC-32."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.spans: dict[tuple[int, int], int] = {}
        self._start = 0
        self._crc = Crc32()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self._crc.update(view[:written])
        return int(written)

    def tell(self) -> int:
        position = int(self.raw.tell())
        if position > self._start:
            self.spans[(self._start, position - self._start)] = self._crc.value
        self._start, self._crc = position, Crc32()
        return position

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed and not self.raw.closed:
            self.tell()  # the last span
        super().close()


class Arrival:
    """The object ``key`` of ``checkpoint``, checked against its ``entry`` as its bytes
    arrive (``update`` each chunk, then ``check``): the CRC-32 of the whole, or, for an entry
    recorded by its segments (a DCP shard's items), of each segment as it passes."""

    def __init__(self, entry: Entry, checkpoint: str, key: str) -> None:
        self.entry, self.checkpoint, self.key = entry, checkpoint, key
        self._crc = Crc32()
        self._size = 0
        self._segments = [] if "crc32" in entry else sorted(entry.get("segments", []))
        self._failure: str | None = None

    def update(self, chunk: bytes) -> None:
        start, self._size = self._size, self._size + len(chunk)
        if not self._segments:
            self._crc.update(chunk)
            return
        view = memoryview(chunk)
        while self._segments and self._failure is None:
            offset, length, stored, label = self._segments[0]
            begin, end = max(offset, start), min(offset + length, self._size)
            if begin >= self._size:
                return
            self._crc.update(view[begin - start : end - start])
            if end < offset + length:
                return
            if self._crc.value != stored:
                what = f" ({label})" if label else ""
                self._failure = (
                    f"the object {self.key} bytes {offset}-{offset + length}{what} have "
                    f"CRC-32 {self._crc.value:08x}, {stored:08x} was written"
                )
            self._segments.pop(0)
            self._crc = Crc32()

    def check(self) -> None:
        size, value, entry = self._size, self._crc.value, self.entry
        if self._failure is None and (size != entry["size"] or value != entry.get("crc32", value)):
            self._failure = (
                f"the object {self.key} has {size} bytes with CRC-32 {value:08x}, its manifest "
                f"records {entry['size']} bytes with {entry.get('crc32', 0):08x}"
            )
        if self._failure is not None:
            raise CheckpointError(
                f"checkpoint {self.checkpoint} is corrupt: {self._failure}. Its bytes changed "
                f"after it was written; {_EARLIER}"
            )


def verify_records(path: Path) -> BadRecord | None:
    """The first record of the torch zip file ``path`` whose bytes do not match its stored
    CRC-32, or None when all match (or the file has no checksums: a legacy, non-zip file or
    one saved with ``torch.serialization.set_crc32_options(False)``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return None  # not a zip: torch.load reports what is wrong with it
    if not records or all(r.CRC == 0 for r in records if r.file_size):
        return None
    with open(path, "rb") as handle, mapped(handle.fileno(), path.stat().st_size) as view:
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED:
                continue  # torch stores; anything else is not ours to check here
            start = data_start(view, record.header_offset)
            if start is None or start + record.file_size > len(view):
                return BadRecord(record.filename, record.file_size, record.CRC, 0)
            actual = span_crc32(view, start, record.file_size)
            if actual != record.CRC:
                return BadRecord(record.filename, record.file_size, record.CRC, actual)
    return None


def entry_of_record(obj: Any, bad: BadRecord) -> str | None:
    """The key path (``model.0.weight``) of the tensor in the loaded ``obj`` whose storage
    holds the bytes of ``bad`` (found by size and the CRC-32 of what was read), or None."""
    for key, tensor in tensors_of(obj, ""):
        storage = tensor.untyped_storage()
        if storage.nbytes() != bad.size:
            continue
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage).cpu()
        if crc32(raw.numpy().tobytes()) == bad.actual:
            return key
    return None


def share(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: the index and the small files on rank 0,
    the shard files round-robin (each rank about one file when the world wrote them)."""
    names = sorted(names)
    small = [n for n in names if not n.endswith(".distcp")]
    shards = [n for n in names if n.endswith(".distcp")]
    mine = [n for i, n in enumerate(shards) if i % world == rank]
    return (small if rank == 0 else []) + mine


def verify_files(folder: Path, rank: int = 0, world: int = 1, required: bool = False) -> None:
    """Check this rank's share of ``folder``'s files against its manifest (rank 0 also reads
    the index safely). Without a manifest: a CheckpointError when ``required``, else
    structural checks only (a folder written before checksums)."""
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
    try:
        verify_files_named(folder, files, mine)
    except CheckpointError as error:
        if manifest.name == folder.name:
            raise
        # A folder's manifest names the folder it was written for; a copy or a rename keeps
        # it (best/ holds its periodic checkpoint's), so only a mismatch says more.
        found = str(error).split(" is corrupt: ", 1)[-1].split(". Its bytes", 1)[0]
        raise CheckpointError(
            f"checkpoint {folder}: its {MANIFEST} was written for {manifest.name!r}, and the "
            f"folder's files do not match it ({found}). It was probably copied here from that "
            f"checkpoint (or the files were replaced): put back this folder's own {MANIFEST}, "
            f"or use an earlier checkpoint."
        ) from error
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
    "Arrival",
    "Passing",
    "check_object",
    "entry_of",
    "entry_of_bytes",
    "entry_of_record",
    "item_entries",
    "verify_records",
    "matches",
    "share",
    "verify_files",
    "verify_files_named",
]
