"""Reading DCP folders without running code from them: the index by an unpickler that builds only
DCP's metadata classes and plain types, values with ``weights_only=True``, and only plain file
names inside the folder (DCP's own reader unpickles both unrestricted).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from nn_handler.checkpoint.unpickling import weights_only_cause
from nn_handler.errors import CheckpointError

#: DCP's index file in a folder.
INDEX = ".metadata"


_METADATA = "torch.distributed.checkpoint.metadata"
#: The (module, name) pairs a DCP index may build: its own dataclasses and the values in them.
_ALLOWED = frozenset(
    {
        (_METADATA, "Metadata"),
        (_METADATA, "MetadataIndex"),
        (_METADATA, "StorageMeta"),
        (_METADATA, "TensorProperties"),
        (_METADATA, "TensorStorageMetadata"),
        (_METADATA, "BytesStorageMetadata"),
        (_METADATA, "ChunkStorageMetadata"),
        (_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, source: Path) -> None:
        super().__init__(stream)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if _allowed(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint index {self._source} asks for {module}.{name}, which is not one of "
            f"DCP's metadata classes: it was refused, because loading never runs code from a "
            f"checkpoint. Do not load this folder unless you know where it came from."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(
            f"checkpoint index {self._source} holds a persistent reference ({pid!r}), which a "
            f"DCP index never does: it was refused."
        )


def read_index(path: str | Path) -> Metadata:
    """DCP's index at ``path`` (a ``.metadata`` file), read without running code: only DCP's
    metadata classes may be built, and every file it names must lie inside its folder.
    Raises CheckpointError naming the file and the cause."""
    source = Path(path)
    try:
        data = source.read_bytes()
    except OSError as error:
        raise CheckpointError(
            f"cannot read checkpoint index {source}: {error.strerror or error}; the folder is "
            f"incomplete (use an earlier checkpoint)."
        ) from error
    try:
        metadata = _IndexUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except Exception as error:  # a torn or foreign index can fail anywhere in the unpickler
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"cannot read checkpoint index {source} ({len(data)} bytes): it is truncated or "
            f"corrupt ({type(error).__name__}: {first}); use an earlier checkpoint."
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint index {source} holds a {type(metadata).__name__}, not DCP Metadata."
        )
    for info in (metadata.storage_data or {}).values():
        _check_relative(source, getattr(info, "relative_path", None))
    return metadata


def _check_relative(source: Path, name: Any) -> None:
    if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
        raise CheckpointError(
            f"checkpoint index {source} names the file {name!r}, which is not a plain file "
            f"name inside its folder: it was refused."
        )


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with the index read by ``read_index``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_index(Path(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with every non-tensor value read weights-only (DCP's own
    reads them with an unrestricted unpickler, which runs whatever a crafted shard asks)."""

    def __init__(self, source: str | Path) -> None:
        super().__init__()
        self._source = str(source)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {self._source}: the value of {fqn!r} was refused by weights-only "
                f"loading ({weights_only_cause(error)}); a shard never needs to run code. Do "
                f"not load this folder unless you know where it came from."
            ) from error
        # What DefaultLoadPlanner.load_bytes does with the value it loads.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


__all__ = ["INDEX", "SafeLoadPlanner", "SafeReader", "read_index"]
