"""The writer process (checkpoint.async_writer: process): an async sharded save whose shards a
child process of the rank serializes, writes and checksums writes the same folder as the
thread does; a child that fails or dies makes that save a CheckpointError and the next save
starts another; the setting needs async_save."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nn_handler import CheckpointError, ConfigError, HandlerConfig
from nn_handler.checkpoint.manifest import read_manifest
from nn_handler.checkpoint.sharded import ShardedWriter
from nn_handler.checkpoint.store import LocalStore
from nn_handler.checkpoint.writer_process import WriterProcess
from nn_handler.distributed.communicator import NullCommunicator

STATE = {"model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}, "n": 7}


def _saved(folder: Path, in_process: bool, saves: int = 2) -> dict[str, Any]:
    """The manifest entries of the last of ``saves`` async saves into ``folder``."""
    writer = ShardedWriter(NullCommunicator(), lambda: None, in_process=in_process)
    try:
        for index in range(saves):
            target = folder / f"ckpt-e0000-s{index:08d}"
            writer.save({"format": "x"}, STATE, target, LocalStore(folder), asynchronous=True)
            writer.wait()
    finally:
        writer.close()
    manifest = read_manifest(target)
    assert manifest is not None
    return {key.split("/", 1)[1]: entry for key, entry in manifest.objects.items()}


def test_a_writer_process_writes_the_folder_the_thread_writes(tmp_path: Path) -> None:
    thread, process = _saved(tmp_path / "thread", False), _saved(tmp_path / "process", True)
    # The same files, sizes and item checksums; DCP's index differs only in its save's id
    # and the folder's path (it names its staging folder).
    assert process.pop(".metadata")["size"] - thread.pop(".metadata")["size"] in range(-64, 65)
    assert process == thread
    labels = {segment[3] for segment in thread["__0_0.distcp"]["segments"]}
    assert labels == {"n", "model.w", "model.b"}


def _fail(conn: Any) -> None:
    while conn.recv() is not None:  # a child that lives on and reports each failure
        conn.send(("error", "OSError: [Errno 28] No space left on device"))


def _die(conn: Any) -> None:
    conn.recv()
    os._exit(3)


@pytest.mark.parametrize(
    ("serve", "said"),
    [
        (_fail, r"failed writing .*: OSError: \[Errno 28\] No space left"),
        (_die, r"writer process \(pid \d+\) died \(exit code 3\) while writing"),
    ],
)
def test_a_child_that_fails_or_dies_is_a_checkpoint_error(serve: Any, said: str) -> None:
    process = WriterProcess(serve)
    try:
        for _ in range(2):  # the next write starts another child
            started = time.perf_counter()
            with pytest.raises(CheckpointError, match=said):
                process.write("/nowhere", None, [])  # type: ignore[arg-type]
            assert time.perf_counter() - started < 120
    finally:
        process.close()


def test_the_process_writer_needs_async_save(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="async_writer='process' writes the background saves"):
        HandlerConfig.from_dict(
            {"checkpoint": {"dir": str(tmp_path), "format": "sharded", "async_writer": "process"}}
        )


def _make_writer(out: Any) -> None:
    try:
        WriterProcess(_fail)
        out.put("made")
    except ConfigError as error:
        out.put(str(error))


def test_a_daemonic_rank_is_told_to_use_the_thread_writer() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_make_writer, args=(out,), daemon=True)
    child.start()
    said = out.get(timeout=120)
    child.join(timeout=30)
    assert "daemonic process" in said and "async_writer='thread'" in said
