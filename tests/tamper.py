"""Tampering with sharded checkpoint folders, as the fault campaign did: a crafted index or
shard value whose unpickling runs a command (it creates a marker file), flipped bits, and
truncated or deleted files. Shared by the one-process and the multi-rank integrity tests."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.checksum import mapped
from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter
from nn_handler.checkpoint.integrity import data_start
from nn_handler.checkpoint.manifest import MANIFEST, read_manifest
from nn_handler.checkpoint.sharded import dcp_save
from nn_handler.checkpoint.store.local import folder_manifest


class Payload:
    """Unpickling it calls ``os.mkdir(marker)``: an attacker's call into the os module, as
    the campaign's ``os.system`` was, without a shell (``system()`` ignores SIGINT in the
    whole process while it runs, which would disturb the tests beside it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.marker,))


def payload_is_live(data: bytes, marker: Path) -> bool:
    """Whether a plain ``pickle.loads`` of ``data`` (what DCP does with an index) runs the
    payload: checked in a child process, the marker removed after."""
    script = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    subprocess.run([sys.executable, "-c", script], input=data, check=False, timeout=60)
    live = marker.exists()
    if live:
        marker.rmdir()
    return live


def craft_index(folder: Path, marker: Path) -> bytes:
    """Replace the folder's ``.metadata`` by a pickle that runs the payload, and its entry in
    the manifest by the forgery's size and checksum (an attacker can write both, so only
    the index's reader can refuse it); the forgery's bytes."""
    data = pickle.dumps(Payload(marker))
    (folder / ".metadata").write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    crc = zlib.crc32(data) & 0xFFFFFFFF
    manifest["objects"][f"{manifest['checkpoint']}/.metadata"] = {"size": len(data), "crc32": crc}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return data


def _first_plain_value(tree: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The path of the first value in ``tree`` that DCP stores as pickled bytes."""
    if isinstance(tree, dict):
        items: Iterator[tuple[Any, Any]] = iter(tree.items())
    elif isinstance(tree, list):
        items = iter(enumerate(tree))
    else:
        return path if isinstance(tree, (int, float, str)) and path else None
    for key, value in items:
        found = _first_plain_value(value, (*path, key))
        if found is not None:
            return found
    return None


def craft_value(folder: Path, shards: dict[str, Any], marker: Path) -> str:
    """Rewrite the folder's shards (one process) with their first plain value (an optimizer's
    learning rate, say) replaced by the payload, with a valid manifest: the checksums match,
    only the loader can refuse it. Returns the dotted name of the value."""
    path = _first_plain_value(shards)
    assert path is not None, "no plain value in the shards"
    node = shards
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = Payload(marker)
    for old in folder.glob("*.distcp"):
        old.unlink()
    (folder / ".metadata").unlink()
    old_manifest = read_manifest(folder)
    assert old_manifest is not None
    (folder / MANIFEST).unlink()
    writer = ChecksummingWriter(str(folder))
    dcp_save(shards, writer, {"process_group": None, "no_dist": True})
    known = {f"{old_manifest.name}/{name}": entry for name, entry in writer.files.items()}
    manifest = folder_manifest(folder, old_manifest.name, old_manifest.run, known)
    (folder / MANIFEST).write_bytes(manifest.to_bytes())
    return ".".join(str(key) for key in path)


def segments(folder: Path) -> dict[str, list[tuple[int, int, str]]]:
    """Every file's (offset, length, label) segments from the folder's manifest."""
    manifest = read_manifest(folder)
    assert manifest is not None
    return {
        name: [(s[0], s[1], s[3]) for s in entry["segments"]]
        if "segments" in entry
        else [(0, entry["size"], "")]
        for name, entry in manifest.files().items()
    }


def flip_bit(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


__all__ = [
    "Payload",
    "craft_index",
    "craft_value",
    "flip_bit",
    "payload_is_live",
    "segments",
    "truncate",
]


def record_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each record of the torch.save zip file ``path``: (offset of its data, size), by name."""
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
    spans: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as handle, mapped(handle.fileno(), path.stat().st_size) as view:
        for record in records:
            start = data_start(view, record.header_offset)
            if start is not None:
                spans[record.filename] = (start, record.file_size)
    return spans
