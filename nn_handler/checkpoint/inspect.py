"""What a checkpoint holds, as text: ``nn-handler checkpoint inspect PATH``.

Reads a file weights-only (memory-mapped, so a large one is not read into memory) and lists
the run's position, then every part with its number of tensors and bytes, shared parts first,
then the per-rank ones. A file that is not an nn_handler training checkpoint (bare weights,
say) is described as a plain state dict. A sharded checkpoint (a folder) is described from its
``trainer.pt`` and DCP's index of the shards, without reading the shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.format import META
from nn_handler.checkpoint.manifest import MANIFEST, read_manifest
from nn_handler.checkpoint.opening import Opened
from nn_handler.checkpoint.safe_dcp import INDEX, read_index
from nn_handler.checkpoint.verify import verify_files_named


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _size(value: Any) -> str:
    tensors = list(_tensors(value))
    if not tensors:
        empty = value is None or (isinstance(value, (Mapping, list, tuple)) and not value)
        return "empty" if empty else "no tensors"
    total = sum(t.numel() * t.element_size() for t in tensors)
    return f"{len(tensors)} tensor(s), {_bytes(total)}"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # pragma: no cover - the loop returns


def describe_checkpoint(opened: Opened) -> str:
    """A few lines saying what the ``opened`` checkpoint holds (raises CheckpointError when
    its index cannot be read)."""
    path, checkpoint = opened.path, opened.contents
    sharded = opened.folder is not None
    lines = [_heading(path, sharded, opened.where)]
    if not isinstance(checkpoint, Mapping) or checkpoint.get("format") != "nn_handler.checkpoint":
        kind = type(checkpoint).__name__
        lines.append(f"not an nn_handler training checkpoint ({kind}): {_size(checkpoint)}")
        if isinstance(checkpoint, Mapping):
            keys = list(checkpoint)
            lines.append(f"keys: {keys[:10]}{' ...' if len(keys) > 10 else ''}")
        return "\n".join(lines)
    position = checkpoint.get("trainer") or {}
    lines.append(
        f"format version {checkpoint.get('version')}, written by "
        f"{checkpoint.get('world_size')} rank(s); epochs done {position.get('epoch')}, "
        f"optimizer steps {position.get('global_step')}, batches done in the epoch "
        f"{position.get('batches_done')}"
    )
    lines.append("shared parts:")
    for name, value in checkpoint.items():
        if name not in META and value is not None:
            lines.append(f"  {name}: {_size(value)}")
    if sharded:
        lines.append(_checksums(path))
        lines.append("sharded parts (whole sizes):")
        lines.extend(f"  {name}: {size}" for name, size in _shard_sizes(path).items())
    ranks = checkpoint.get("ranks") or []
    if ranks:
        names = sorted({name for rank in ranks for name, v in rank.items() if v is not None})
        lines.append(f"per-rank parts ({len(ranks)} rank(s)): {', '.join(names)}")
    config = checkpoint.get("config") or {}
    if config:
        lines.append(f"config sections: {', '.join(sorted(config))}")
    return "\n".join(lines)


def _heading(path: Path, sharded: bool, where: str) -> str:
    if not sharded:
        return f"{where} ({_bytes(path.stat().st_size)})"
    shards = sorted(path.glob("*.distcp"))
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return f"{where} (sharded: {len(shards)} shard file(s), {_bytes(total)} in all)"


def _checksums(folder: Path) -> str:
    """What the folder's manifest covers; its index is checked against it here (the shards
    are not read: ``nn-handler checkpoint verify`` reads them)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "checksums: none (written before nn_handler stored them)"
    files = manifest.files()
    if INDEX in files:
        verify_files_named(folder, files, [INDEX])
    segments = sum(len(entry.get("segments", [])) for entry in files.values())
    return f"checksums: {MANIFEST} covers {len(files)} file(s) in {segments} segment(s)"


def _shard_sizes(folder: Path) -> dict[str, str]:
    """Every sharded part's number of tensors and bytes, from DCP's index (read without
    running code)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_index(folder / INDEX)
    counts: dict[str, list[int]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            count = counts.setdefault(fqn.split(".", 1)[0], [0, 0])
            count[0] += 1
            count[1] += entry.size.numel() * entry.properties.dtype.itemsize
    return {name: f"{n} tensor(s), {_bytes(size)}" for name, (n, size) in counts.items()}


__all__ = ["describe_checkpoint"]
