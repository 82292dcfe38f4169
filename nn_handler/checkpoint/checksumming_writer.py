"""ChecksummingWriter: DCP's FileSystemWriter that has every item it writes checksummed (by the
verifier, checkpoint/verify.py) and gathers the entries on rank 0 for the folder's manifest,
which the store writes when it commits the folder (DCP itself stores no checksum)."""

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

from nn_handler.checkpoint.manifest import Entry
from nn_handler.checkpoint.safe_dcp import INDEX
from nn_handler.checkpoint.verify import item_entries


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
        infos: list[_StorageInfo] = [results[p].storage_data for p in positions]
        size, segments = item_entries(folder / name, [(i.offset, i.length, "") for i in infos])
        for position, info, segment in zip(positions, infos, segments, strict=True):
            extended = _CheckedInfo(
                info.relative_path, info.offset, info.length, info.transform_descriptors,
                crc32=segment[2], file_size=size,
            )  # fmt: skip
            checked[position] = dataclasses.replace(results[position], storage_data=extended)
    return checked


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that checksums every item it writes; rank 0 (the coordinator)
    writes DCP's index and keeps every shard file's entry in ``files``."""

    #: The files this rank wrote (its shards; on the coordinator also the index), filled as
    #: they are written: what it uploads to an object store.
    written: list[str]
    #: On the coordinator once finished: each shard file's size and segments, by name.
    files: dict[str, Entry]

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
        for entry in files.values():
            entry["segments"].sort()
        self.files = files
        self.written = sorted({*getattr(self, "written", []), INDEX})


__all__ = ["ChecksummingWriter", "checksum_results"]
