"""Checkpoint files: writing one into its staging path (``write_file``: torch.save, fsynced,
cancellable; its store commits it: checkpoint/store/files.py) and loading one safely
(``load_file``: always ``torch.load(weights_only=True)``, so a checkpoint cannot run code, its
records' CRC-32s checked while it loads).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

from nn_handler.checkpoint.integrity import BadRecord
from nn_handler.checkpoint.unpickling import weights_only_cause
from nn_handler.checkpoint.verify import entry_of_record, verify_records
from nn_handler.errors import CheckpointError


class SaveCancelled(CheckpointError):
    """A save was cancelled (its budget ran out) before its file was committed."""


class _CancellableFile(io.RawIOBase):
    """A write-only file that raises ``SaveCancelled`` at its next write once ``cancel``
    is set; large writes go in chunks, so a cancelled save stops within one chunk."""

    CHUNK = 8 << 20

    def __init__(self, raw: BinaryIO, cancel: threading.Event) -> None:
        super().__init__()
        self._raw = raw
        self._cancel = cancel

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), self.CHUNK):
            if self._cancel.is_set():
                raise SaveCancelled("the save was cancelled")
            self._raw.write(view[start : start + self.CHUNK])
        return len(view)


def write_file(
    obj: Any, path: Path, cancel: threading.Event | None = None, name: str | Path | None = None
) -> None:
    """``torch.save(obj)`` to the staging file ``path``, fsynced (its store commits it);
    ``name``: the checkpoint it will be, for errors. With ``cancel`` (set from another
    thread) the save stops at its next write and raises ``SaveCancelled``. On any failure
    the file is removed."""
    target = str(name or path)
    try:
        if cancel is None:
            torch.save(obj, path)  # by path: torch's own writer, the fastest
        else:
            with open(path, "wb") as raw, _CancellableFile(raw, cancel) as stream:
                torch.save(obj, cast("IO[bytes]", stream))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as error:
        with contextlib.suppress(OSError):
            path.unlink()
        if isinstance(error, SaveCancelled):
            raise
        cancelled = error.__context__ if isinstance(error.__context__, SaveCancelled) else None
        if cancelled is not None:  # torch's writer wraps the exception raised in write()
            raise SaveCancelled(f"the save to {target} was cancelled") from error
        if isinstance(error, OSError) or "unexpected pos" in str(error):
            raise CheckpointError(write_failure(target, path, error, obj)) from error
        raise


def write_failure(target: str, place: Path, error: BaseException, obj: Any) -> str:
    """What went wrong writing the checkpoint ``target`` (as the user names it) at ``place``
    on this machine: a full disk is named as such (torch reports it as 'unexpected pos N vs
    M'), with the space needed and left where they can be known."""
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    if full or "unexpected pos" in str(error):
        needed = _tensor_bytes(obj)
        try:
            free = shutil.disk_usage(place.parent).free
        except OSError:
            free = None
        if full or (free is not None and free < needed + (1 << 20)):
            sizes = f"the checkpoint needs about {needed} bytes"
            sizes += f", {free} bytes are free there" if free is not None else ""
            return (
                f"cannot write checkpoint {target}: no space left on device ({sizes}). Free "
                f"space or point CheckpointConfig(dir=...) at a larger file system."
            )
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"cannot write checkpoint {target}: {first}"


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _describe_size(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes"
    except OSError:
        return "size unknown"


def load_file(
    path: str | Path,
    map_location: torch.device | str | None = None,
    trusted: Iterable[type[Any] | Any] = (),
    mmap: bool = False,
    verify: bool = True,
) -> Any:
    """``torch.load(path, weights_only=True)`` (on CPU unless ``map_location``; ``trusted``:
    extra classes to allow), its records' CRC-32s checked unless not ``verify``. Raises
    CheckpointError naming the path, the cause, or the first bad entry."""
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"no checkpoint file at {source}.")
    where = map_location if map_location is not None else "cpu"
    verdict: list[BadRecord | None] = []
    checker = threading.Thread(
        target=lambda: verdict.append(verify_records(source)), name="nn_handler-crc32"
    )
    if verify:
        checker.start()
    loaded: Any = None
    failure: BaseException | None = None
    try:
        with torch.serialization.safe_globals(list(trusted)):
            loaded = torch.load(source, map_location=where, weights_only=True, mmap=mmap)
    except Exception as error:  # a foreign or torn file can fail anywhere in the unpickler
        failure = error
    if verify:
        checker.join()
    bad = verdict[0] if verdict else None
    if bad is not None:
        entry = entry_of_record(loaded, bad) if loaded is not None else None
        named = f"entry {entry!r}, " if entry else ""
        raise CheckpointError(
            f"checkpoint {source} is corrupt: {named}{bad.describe()}. Its bytes changed after "
            f"it was written (a disk or copy error); use an earlier checkpoint."
        ) from failure
    if failure is not None:
        raise CheckpointError(_load_failure(source, failure)) from failure
    return loaded


#: Modules whose callables run commands or code: a checkpoint that names one is an attack,
#: never something to allowlist.
_DANGEROUS_MODULES = frozenset(
    {"os", "posix", "nt", "subprocess", "sys", "shutil", "socket", "builtins", "__builtin__",
     "importlib", "runpy", "pty", "code", "codeop", "pickle", "marshal", "ctypes", "webbrowser"}
)  # fmt: skip
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _load_failure(source: Path, error: BaseException) -> str:
    """The message for a file torch.load refused: a blocked global (named, with how to allow
    it unless it is a code-running callable) or an unreadable file."""
    text = str(error)
    if not isinstance(error, pickle.UnpicklingError) or not (
        "weights_only" in text or "Unsupported global" in text or "Weights only" in text
    ):
        return _unreadable(source, error)
    found = _GLOBAL.search(text)
    size = _describe_size(source)
    if found is None:
        first = weights_only_cause(error)
        return (
            f"checkpoint {source} ({size}) has a pickle stream that weights-only loading "
            f"cannot read ({first}): it is corrupt or was not written by torch.save; use an "
            f"earlier checkpoint."
        )
    name = found.group(1)
    module, _, attribute = name.rpartition(".")
    if module.split(".")[0] in _DANGEROUS_MODULES:
        return (
            f"checkpoint {source} ({size}) asks to call {name} when it is loaded: that runs "
            f"code, so it was refused. Do not allow it; do not load this file unless you know "
            f"where it came from."
        )
    return (
        f"checkpoint {source} ({size}) holds an object of {name}, which weights-only loading "
        f"refuses. If you trust this file, allow that class: pass trusted=[{attribute}] (from "
        f"{module} import {attribute}) or call "
        f"torch.serialization.add_safe_globals([{attribute}]) before loading."
    )


def _unreadable(source: Path, error: BaseException) -> str:
    size = _describe_size(source)
    hint = "it is empty" if size == "0 bytes" else "it is truncated, corrupt or not a torch file"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"cannot read checkpoint {source} ({size}): {hint} ({type(error).__name__}: {first})."


def unsafe_entries(obj: Any, prefix: str = "") -> list[str]:
    """Key paths in ``obj`` holding values that weights-only loading refuses (e.g. functions or
    custom classes); empty when every value is a tensor, number, string, container, dtype..."""
    found: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += unsafe_entries(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for index, value in enumerate(obj):
            found += unsafe_entries(value, f"{prefix}[{index}]")
    elif not isinstance(obj, _SAFE_LEAVES):
        found.append(f"{prefix or '(root)'} ({type(obj).__name__})")
    return found


_SAFE_LEAVES = (
    torch.Tensor,
    torch.Size,
    torch.dtype,
    torch.device,
    int,
    float,
    bool,
    str,
    bytes,
    complex,
    type(None),
)


__all__ = [
    "SaveCancelled",
    "load_file",
    "unsafe_entries",
    "write_failure",
    "write_file",
]
