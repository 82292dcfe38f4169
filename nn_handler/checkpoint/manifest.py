"""The manifest of a checkpoint: each object's size and CRC-32 (of the whole, and/or of its
segments: a DCP shard's items), keyed relative to the checkpoint's folder, written last by the
store that commits it. Formats and places: docs/checkpoints.md, "Integrity of both formats".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from nn_handler.errors import CheckpointError

#: A local folder's manifest file.
MANIFEST = "manifest.json"
#: The suffix of a checkpoint's manifest beside it on an object store.
SUFFIX = ".manifest.json"
_FORMAT = "nn_handler.manifest"  # v1: a folder's ``files``; v2: ``objects``, written now
_STORE_FORMAT_V1 = "nn_handler.remote-manifest"
_VERSION = 2

#: A part of an object: [offset, length, CRC-32, what it holds ('' when nothing to name)].
Segment = list[Any]


class _Sized(TypedDict):
    size: int


class Entry(_Sized, total=False):
    """One object: its size, and the CRC-32 of all of it and/or of its segments (plain JSON
    values, so that it travels in object collectives and manifests as it is)."""

    crc32: int
    segments: list[Segment]


@dataclass
class Manifest:
    """A checkpoint's objects (by key relative to its folder) and the run that wrote it."""

    name: str
    objects: dict[str, Entry]
    run: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The manifest as it is written, in either place."""
        data = {"format": _FORMAT, "version": _VERSION, "checkpoint": self.name,
                "run": self.run, "objects": self.objects, **self.extra}  # fmt: skip
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """A checkpoint's manifest (v2, or an object store's v1); ``where`` names it in
        errors. Every key must be the checkpoint or a plain file in it."""
        try:
            loaded = json.loads(data)
            objects = loaded["objects"]
            kind = (loaded.get("format"), int(loaded.get("version", 0)))
            v1 = kind[0] == _STORE_FORMAT_V1
            ok = (v1 or (kind[0] == _FORMAT and kind[1] >= 2)) and isinstance(objects, dict)
            entries = {str(k): _entry(v, whole=v1) for k, v in objects.items()} if ok else {}
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{where} is not a readable checkpoint manifest: {error}"
            ) from None
        if not ok:
            raise CheckpointError(f"{where} is not an nn_handler checkpoint manifest.")
        if kind[1] > (1 if v1 else _VERSION):
            raise CheckpointError(f"{where} has a newer format; upgrade nn_handler to read it.")
        name, run = loaded.get("checkpoint"), loaded.get("run")
        _check_keys(name, entries, where)
        return cls(str(name), entries, run if isinstance(run, str) else None)

    # ----------------------------------------------------------------- a sharded folder's
    def files(self) -> dict[str, Entry]:
        """The objects of a folder checkpoint by their name inside it."""
        prefix = f"{self.name}/"
        return {k[len(prefix) :]: v for k, v in self.objects.items() if k.startswith(prefix)}


def _entry(value: Any, whole: bool) -> Entry:
    entry: Entry = {"size": int(value["size"])}
    if whole or "crc32" in value:
        entry["crc32"] = int(value["crc32"])
    if "segments" in value:
        entry["segments"] = [[int(o), int(n), int(c), str(w)] for o, n, c, w in value["segments"]]
    return entry


def _plain(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and (name not in (".", ".."))
    )


def _check_keys(name: object, objects: dict[str, Entry], where: str) -> None:
    """Every key of a manifest must be its checkpoint's name or a plain file name under it:
    a download never writes outside the checkpoint's own local copy."""
    bad = [] if _plain(name) else [str(name)]
    for key in objects:
        rest = key[len(str(name)) :]
        if key != name and not (rest.startswith("/") and _plain(rest[1:])):
            bad.append(key)
    if bad:
        raise CheckpointError(
            f"{where} names {bad[0]!r}, which is not its checkpoint or a plain file in it: it "
            f"was refused (a download never writes outside the checkpoint's folder)."
        )


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest inside the local folder ``folder`` (None when it has none); a
    CheckpointError when it is unreadable, not ours or newer than this release."""
    path = folder / MANIFEST
    where = f"checkpoint {folder}: {MANIFEST}"
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: its {MANIFEST} is unreadable ({type(error).__name__}: "
            f"{error}); use an earlier checkpoint."
        ) from error
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CheckpointError(f"{where} is not an nn_handler manifest.")
    version = manifest.get("version", 0)
    if not isinstance(version, int) or version > _VERSION:
        raise CheckpointError(
            f"{where} has format version {version}; upgrade nn_handler to verify it."
        )
    if version >= 2:
        return Manifest.from_bytes(data, where)
    files: Any = manifest.get("files")
    try:
        objects = {f"{folder.name}/{k}": _entry(v, whole=False) for k, v in files.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{where} is not a readable manifest ({error}).") from None
    _check_keys(folder.name, objects, where)
    return Manifest(folder.name, objects)


def manifest_name(name: str) -> str:
    """The object holding the manifest of the checkpoint ``name`` on an object store."""
    return f"{name}{SUFFIX}"


__all__ = [
    "MANIFEST",
    "SUFFIX",
    "Entry",
    "Manifest",
    "Segment",
    "manifest_name",
    "read_manifest",
]
