"""ChecksummingWriter: DCP's FileSystemWriter that has every item it writes checksummed as its
bytes pass to the file (by the verifier, checkpoint/verify.py: never read back) and gathers
the entries on rank 0 for the folder's manifest, which the store writes when it commits the
folder (DCP itself stores no checksum)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from nn_handler.checkpoint.manifest import Entry
from nn_handler.checkpoint.safe_dcp import INDEX
from nn_handler.checkpoint.sharded_errors import SaveRefused
from nn_handler.checkpoint.verify import Passing, item_entries


@dataclass
class _CheckedInfo(_StorageInfo):
    """DCP's per-item storage info with the item's CRC-32 and its file's size (only on its way
    to rank 0: the index stores the plain ``_StorageInfo``)."""

    crc32: int = 0
    file_size: int = 0


class _PassingFileSystem(FileSystem):
    """DCP's local file system whose write streams checksum what passes (``seen``: by file
    name)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, dict[tuple[int, int], int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or not str(path).endswith(DEFAULT_SUFFIX):  # a shard only
                yield stream
                return
            passing = Passing(stream)
            try:
                yield passing
            finally:
                passing.close()
                self.seen[Path(path).name] = passing.spans


def checksum_results(
    folder: Path,
    results: Sequence[WriteResult],
    seen: Mapping[str, Mapping[tuple[int, int], int]] | None = None,
) -> list[WriteResult]:
    """``results`` with each item's CRC-32: as ``seen`` while it was written, else read back
    from the file."""
    by_file: dict[str, list[int]] = {}
    for position, result in enumerate(results):
        by_file.setdefault(result.storage_data.relative_path, []).append(position)
    checked: list[WriteResult] = list(results)
    for name, positions in by_file.items():
        infos: list[_StorageInfo] = [results[p].storage_data for p in positions]
        spans = (seen or {}).get(name, {})
        crcs = [spans.get((i.offset, i.length)) for i in infos]
        size = (folder / name).stat().st_size
        if any(crc is None for crc in crcs):  # a span the stream did not see: read it back
            size, read = item_entries(folder / name, [(i.offset, i.length, "") for i in infos])
            crcs = [segment[2] for segment in read]
        for position, info, crc in zip(positions, infos, crcs, strict=True):
            extended = _CheckedInfo(
                info.relative_path, info.offset, info.length, info.transform_descriptors,
                crc32=int(crc or 0), file_size=size,
            )  # fmt: skip
            checked[position] = dataclasses.replace(results[position], storage_data=extended)
    return checked


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that checksums every item it writes; rank 0 (the coordinator)
    writes DCP's index and keeps every shard file's entry in ``files``."""

    #: The files this rank wrote (its shards; on the coordinator also the index), filled as
    #: they are written: what it uploads to an object store.
    written: list[str]
    #: This rank's shard files' entries (size and segments), by name, once written.
    entries: dict[str, Entry]
    #: On the coordinator once finished: every rank's, by name.
    files: dict[str, Entry]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = self.streams = _PassingFileSystem()
        #: Why this rank's part of the save must not go on (its state could not be copied,
        #: rank 0's preparation failed): raised in DCP's local planning, which DCP reports
        #: to every rank before any of them writes.
        self.refusal: str | None = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.refusal is not None:
            raise SaveRefused(self.refusal)
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).wait()
        checked = checksum_results(Path(self.path), written, self.streams.seen)
        names = {result.storage_data.relative_path for result in checked}
        self.written = sorted(set(getattr(self, "written", [])) | names)
        self.entries = _entries([checked])
        done: Future[list[WriteResult]] = Future()
        done.set_result(checked)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plain = [
            [
                dataclasses.replace(result, storage_data=_plain(result.storage_data))
                for result in row
            ]
            for row in results
        ]
        super().finish(metadata, plain)
        self.files = _entries(results)
        self.written = sorted({*getattr(self, "written", []), INDEX})


def _plain(info: _StorageInfo) -> _StorageInfo:
    """DCP's own storage info (the index stores no checksum)."""
    return _StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)


def _entries(results: list[list[WriteResult]]) -> dict[str, Entry]:
    """Each shard file's entry (its size and every item's segment) from checked results."""
    files: dict[str, Entry] = {}
    for result in (result for row in results for result in row):
        info = result.storage_data
        if isinstance(info, _CheckedInfo):
            entry = files.setdefault(info.relative_path, {"size": info.file_size, "segments": []})
            entry["segments"].append([info.offset, info.length, info.crc32, result.index.fqn])
    for entry in files.values():
        entry["segments"].sort()
    return files


__all__ = ["ChecksummingWriter", "checksum_results"]
