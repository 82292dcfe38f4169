"""ChecksummingWriter: DCP's FileSystemWriter that checksums every item it writes and has rank 0
write ``manifest.json`` (checkpoint/manifest.py) once DCP's index is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from nn_handler.checkpoint.checksum import mapped, span_crc32
from nn_handler.checkpoint.manifest import MANIFEST, Entry, write_manifest
from nn_handler.checkpoint.safe_dcp import INDEX


@dataclass
class _CheckedInfo(_StorageInfo):
    """DCP's per-item storage info with the item's CRC-32 and its file's size (only on its way
    to rank 0: the index stores the plain ``_StorageInfo``)."""

    crc32: int = 0
    file_size: int = 0


def checksum_results(folder: Path, results: Sequence[WriteResult]) -> list[WriteResult]:
    """``results`` with each item's CRC-32, read back from the files just written."""
    by_file: dict[str, list[int]] = {}
    for position, result in enumerate(results):
        by_file.setdefault(result.storage_data.relative_path, []).append(position)
    checked: list[WriteResult] = list(results)
    for name, positions in by_file.items():
        path = folder / name
        size = path.stat().st_size
        with open(path, "rb") as handle, mapped(handle.fileno(), size) as view:
            for position in positions:
                info: _StorageInfo = results[position].storage_data
                crc = span_crc32(view, info.offset, info.length)
                extended = _CheckedInfo(
                    info.relative_path, info.offset, info.length, info.transform_descriptors,
                    crc32=crc, file_size=size,
                )  # fmt: skip
                checked[position] = dataclasses.replace(results[position], storage_data=extended)
    return checked


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that checksums every item it writes; rank 0 (the coordinator)
    writes DCP's index and then ``manifest.json`` covering every file of the folder."""

    #: The files this rank wrote (its shards; on the coordinator also the index and the
    #: manifest), filled as they are written: what it uploads to an object store.
    written: list[str]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).wait()
        names = {result.storage_data.relative_path for result in written}
        self.written = sorted(set(getattr(self, "written", [])) | names)
        done: Future[list[WriteResult]] = Future()
        done.set_result(checksum_results(Path(self.path), written))
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, Entry] = {}
        plain: list[list[WriteResult]] = []
        for per_rank in results:
            row = []
            for result in per_rank:
                info = result.storage_data
                if isinstance(info, _CheckedInfo):
                    entry = files.setdefault(
                        info.relative_path, {"size": info.file_size, "segments": []}
                    )
                    label = result.index.fqn
                    entry["segments"].append([info.offset, info.length, info.crc32, label])
                    info = _StorageInfo(
                        info.relative_path, info.offset, info.length, info.transform_descriptors
                    )
                row.append(dataclasses.replace(result, storage_data=info))
            plain.append(row)
        super().finish(metadata, plain)
        write_manifest(Path(self.path), files)
        self.written = sorted({*getattr(self, "written", []), INDEX, MANIFEST})


__all__ = ["ChecksummingWriter", "checksum_results"]
