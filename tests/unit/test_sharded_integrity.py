"""Sharded checkpoints are as trustworthy as single files (the fault campaign's items 1-4, in
one process; tests/distributed/test_sharded_integrity.py has the multi-rank cases): a crafted
index or shard value never runs (inspect and consolidate as real command-line processes,
NNHandler.load, resume); a flipped bit in any file is caught, naming the file and the tensor,
and resume falls back past it; so does a deleted or truncated shard, index or manifest; a
full disk during a sharded save is named; consolidate never writes into its source."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from torch import nn

from nn_handler import CheckpointError, HandlerConfig, NNHandler
from nn_handler.checkpoint.consolidate import consolidate
from nn_handler.checkpoint.format import CHECKSUMS, REST
from nn_handler.checkpoint.manifest import MANIFEST
from tests.forked import Script, run_script_split
from tests.tamper import (
    craft_index,
    craft_value,
    flip_bit,
    payload_is_live,
    segments,
    truncate,
)
from tests.training_helpers import max_difference, mlp, regression_data, state_of

ROOT = Path(__file__).parents[2]
DATA = regression_data()
FIRST, SECOND = "ckpt-e0001-s00000005", "ckpt-e0002-s00000010"


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _handler(folder: Path | None, seed: int = 0, **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "shuffle": True, "seed": 3},
            "trainer": {"progress_bar": False},
            "ema": {"enabled": True, "decay": 0.9},
            "checkpoint": {
                "dir": None if folder is None else str(folder),
                "format": "sharded",
                "keep_last": 5,
                "resume": "never",
                **checkpoint,
            },
        }
    )
    return NNHandler(mlp(seed=seed), _adam, nn.CrossEntropyLoss(), config=config)


def _shards(handler: NNHandler) -> dict[str, Any]:
    parts = handler.trainer.checkpointing.registry.sharded()
    found = {p.name: p.shards() for p in parts if p.shards is not None}
    return {name: state for name, state in found.items() if state}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two epochs with a sharded checkpoint after each, and the weights after the first."""
    folder = tmp_path_factory.mktemp("pristine")
    with _handler(folder) as h:
        h.train(DATA, epochs=1)
        first = state_of(h.model)
        h.train(DATA, epochs=2)
    return {"folder": folder, "first": first}


@pytest.fixture
def run(pristine: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the pristine run folder to tamper with."""
    copy = tmp_path / "run"
    shutil.copytree(pristine["folder"], copy)
    return copy


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    yield seen
    logger.remove(sink)
    logger.disable("nn_handler")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m nn_handler.cli checkpoint ...`` (forked from the preloaded forkserver:
    tests/forked.py)."""
    script = Script(module="nn_handler.cli", args=("checkpoint", *args))
    code, out, err = run_script_split(script, timeout=120, cwd=ROOT)
    return subprocess.CompletedProcess(["python", "-m", "nn_handler.cli", *args], code, out, err)


# ----------------------------------------------------------------- 1. code never runs
def test_a_crafted_index_runs_nothing_on_any_path(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    newest = run / SECOND
    data = craft_index(newest, marker)
    assert payload_is_live(data, marker)  # DCP's own pickle.load would run it
    inspected = _cli("inspect", str(newest))
    assert inspected.returncode == 1
    assert "asks for posix.mkdir" in inspected.stderr and "refused" in inspected.stderr
    consolidated = _cli("consolidate", str(newest), str(tmp_path / "out.pt"))
    assert consolidated.returncode == 1 and ".metadata" in consolidated.stderr
    with pytest.raises(CheckpointError, match=r"\.metadata.*posix\.mkdir"):
        NNHandler.load(newest, mlp(seed=5))
    with _handler(None, seed=5) as h, pytest.raises(CheckpointError, match=r"posix\.mkdir"):
        h.trainer.resume(newest)
    with _handler(run, seed=5) as h:  # the latest falls back to the intact first folder
        assert h.trainer.resume("latest") == run / FIRST
    assert not marker.exists()


def test_a_crafted_value_in_a_shard_runs_nothing(run: Path, tmp_path: Path) -> None:
    """The shard's value (the optimizer's learning rate) is the payload and the manifest is
    valid (an attacker can write one): weights-only reading of the shard's values refuses
    it. (consolidate reads the model and EMA only, never an optimizer's values.)"""
    marker = tmp_path / "pwned"
    newest = run / SECOND
    with _handler(None) as h:
        name = craft_value(newest, _shards(h), marker)
    import torch.distributed.checkpoint as dcp

    with _handler(None) as h:  # stock DCP runs it: the crafted folder is live
        dcp.load(_shards(h), checkpoint_id=str(newest), no_dist=True)
    assert marker.exists()
    marker.rmdir()
    assert name.startswith("optimizer.")
    with pytest.raises(CheckpointError, match=rf"value of '{name}' was refused") as refused:
        NNHandler.load(newest, mlp(seed=5), _adam)
    # Never torch's advice to re-run with weights_only=False, which would run the payload.
    assert "weights_only" not in str(refused.value) and "Re-running" not in str(refused.value)
    with _handler(None, seed=5) as h, pytest.raises(CheckpointError, match="weights-only"):
        h.trainer.resume(newest)
    assert not marker.exists()


def test_an_index_naming_a_file_outside_its_folder_is_refused(run: Path) -> None:
    import pickle

    from nn_handler.checkpoint.safe_dcp import read_index

    index = run / SECOND / ".metadata"
    metadata = read_index(index)
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../../etc/passwd"
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a plain file name inside its folder"):
        read_index(index)


# ----------------------------------------------------------------- 2. checksums
def _middle(segment: tuple[int, int, str]) -> int:
    offset, length, _ = segment
    return offset + length // 2


def test_a_flipped_bit_anywhere_is_named_and_resume_falls_back(
    run: Path, pristine: dict[str, Any], warnings_seen: list[str]
) -> None:
    """One bit flipped in the middle of every item of every file, one at a time: each is
    caught with the file and the tensor named, and resume('latest') falls back."""
    newest = run / SECOND
    layout = segments(newest)
    labels = {label.split(".")[0] for _, _, label in layout["__0_0.distcp"]}
    assert {"model", "optimizer", "ema"} <= labels
    checked = 0
    for name, parts in layout.items():
        for segment in parts:
            target = newest / name
            original = target.read_bytes()
            flip_bit(target, _middle(segment))
            label = segment[2]
            with pytest.raises(CheckpointError, match="corrupt") as caught:
                consolidate(newest, run.parent / "out.pt")
            assert name in str(caught.value) and label in str(caught.value)
            target.write_bytes(original)
            checked += 1
    assert checked == sum(len(p) for p in layout.values()) > 20
    # A weight flipped in the newest folder: resume falls back to the first, exactly.
    model = next(s for s in layout["__0_0.distcp"] if s[2].startswith("model."))
    flip_bit(newest / "__0_0.distcp", _middle(model))
    with _handler(run, seed=5) as h:
        assert h.trainer.resume("latest") == run / FIRST
        assert max_difference(state_of(h.model), pristine["first"]) == 0.0
    assert any(f"{model[2]}" in w and "trying the previous checkpoint" in w for w in warnings_seen)


def _delete(path: Path) -> None:
    path.unlink()


DAMAGE = {
    "deleted shard": ("__0_0.distcp", _delete, "is missing"),
    "truncated shard": ("__0_0.distcp", truncate, "truncated"),
    "deleted index": (".metadata", _delete, "is missing"),
    "truncated index": (".metadata", truncate, "truncated"),
    "deleted manifest": (MANIFEST, _delete, "manifest.json .* is missing"),
    "truncated manifest": (MANIFEST, truncate, "manifest.json is unreadable"),
    "truncated trainer.pt": (REST, truncate, "trainer.pt"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_folder_is_skipped_with_its_reason(
    run: Path, pristine: dict[str, Any], damage: str, warnings_seen: list[str]
) -> None:
    name, harm, reason = DAMAGE[damage]
    harm(run / SECOND / name)
    with _handler(run, seed=5, resume="auto") as h:  # resume: auto takes the same path
        h.train(DATA, epochs=1)  # already trained to epoch 1: resumes, trains nothing
        assert h.trainer.state.epoch == 1
        assert max_difference(state_of(h.model), pristine["first"]) == 0.0
    skipped = [w for w in warnings_seen if "trying the previous checkpoint" in w]
    assert len(skipped) == 1 and SECOND in skipped[0], warnings_seen
    import re

    assert re.search(reason, skipped[0]), skipped[0]


def test_an_explicit_folder_that_is_damaged_is_an_error_naming_it(run: Path) -> None:
    truncate(run / SECOND / "__0_0.distcp")
    with _handler(None, seed=5) as h, pytest.raises(CheckpointError, match="truncated"):
        h.trainer.resume(run / SECOND)


def test_a_folder_from_before_checksums_loads_with_structural_checks(run: Path) -> None:
    """No manifest and no 'checksums' entry (an earlier nn_handler wrote it): it loads; a
    shard it names that is missing is still caught."""
    folder = run / SECOND
    (folder / MANIFEST).unlink()
    rest = torch.load(folder / REST, weights_only=True)
    del rest[CHECKSUMS]
    torch.save(rest, folder / REST)
    with _handler(None, seed=5) as h:
        assert h.trainer.resume(folder) == folder
        assert h.trainer.state.epoch == 2
    (folder / "__0_0.distcp").unlink()
    with _handler(None, seed=5) as h, pytest.raises(CheckpointError, match="is missing"):
        h.trainer.resume(folder)


def test_inspect_reports_the_checksums(pristine: dict[str, Any]) -> None:
    done = _cli("inspect", str(pristine["folder"] / SECOND))
    assert done.returncode == 0, done.stderr
    assert "checksums: manifest.json covers 3 file(s)" in done.stdout


# ----------------------------------------------------------------- 4. a full disk
def _tiny_file_system(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.mark.parametrize("background", [False, True])
def test_a_full_disk_during_a_sharded_save_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """On a real 96 KiB file system where mounting is allowed (root), else with the disk's
    error raised by the shard writes; trainer.pt fits, the shards do not. In the background
    too (``async_save``: the periodic save fails when the end of the fit waits for it), where
    the message once said the shards 'need about 0 bytes'."""
    disk = tmp_path / "disk"
    mounted = _tiny_file_system(disk, "96k")
    if not mounted:
        from torch.distributed.checkpoint import filesystem

        def no_space(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 70 vs 59")

        monkeypatch.setattr(filesystem, "_write_item", no_space)
        monkeypatch.setattr("shutil.disk_usage", lambda _: type("U", (), {"free": 100})())
    try:
        big = nn.Sequential(nn.Linear(6, 2048), nn.ReLU(), nn.Linear(2048, 3))
        checkpoint: dict[str, Any] = {"format": "sharded"}
        if background:
            checkpoint.update(dir=str(disk), async_save=True)
        config = HandlerConfig.from_dict(
            {"trainer": {"progress_bar": False}, "checkpoint": checkpoint}
        )
        with NNHandler(big, _adam, nn.CrossEntropyLoss(), config=config) as h:
            if background:
                with pytest.raises(CheckpointError) as caught:
                    h.train(DATA, epochs=1)
            else:
                h.train(DATA, epochs=1)
                with pytest.raises(CheckpointError) as caught:
                    h.save(disk / "ckpt")
        message = str(caught.value)
        assert "no space left on device" in message and "this rank's shards need about" in message
        needed = re.search(r"shards need about (\d+) bytes", message)
        assert needed and int(needed.group(1)) > 2048 * 6 * 4, message  # the first layer alone
        assert "bytes are free" in message and "inline_container" not in message
        assert not (disk / "ckpt").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


# ----------------------------------------------------------------- 8. consolidate's output
def test_consolidate_never_writes_into_its_source(run: Path) -> None:
    folder = run / SECOND
    before = (folder / REST).read_bytes()
    done = _cli("consolidate", str(folder), str(folder / REST))
    assert done.returncode == 1 and "inside the checkpoint" in done.stderr
    assert (folder / REST).read_bytes() == before
    with pytest.raises(CheckpointError, match="write it elsewhere"):
        consolidate(folder, folder / "sub" / "model.pt")


# ----------------------------------------------------------------- 8. loading an FSDP run's
def test_an_fsdp_runs_folder_loads_in_one_process_with_the_model_as_it_is(run: Path) -> None:
    """Its stored config says strategy fsdp, which needs a process group: NNHandler.load in
    one process takes 'auto' instead (as consolidate does)."""
    folder = run / SECOND
    rest = torch.load(folder / REST, weights_only=True)
    rest["config"]["handler"]["trainer"]["strategy"] = "fsdp"
    rest["world_size"] = 2
    torch.save(rest, folder / REST)
    from nn_handler.checkpoint.manifest import MANIFEST, read_manifest
    from nn_handler.checkpoint.verify import entry_of

    manifest = read_manifest(folder)
    assert manifest is not None
    manifest.objects[f"{manifest.name}/{REST}"] = entry_of(folder / REST)  # the edit, recorded
    (folder / MANIFEST).write_bytes(manifest.to_bytes())
    with NNHandler.load(folder, mlp(seed=5)) as h:
        assert h.trainer.state.epoch == 2
        assert type(h.trainer.strategy).__name__ != "FSDPStrategy"


# ----------------------------------------------------------------- the error paths, one each
def test_the_folder_lock_takes_over_only_what_is_stale(tmp_path: Path) -> None:
    import json as jsonlib
    import socket

    from nn_handler.checkpoint.store.lease import LOCK, FileLock, Lease

    def lease() -> Lease:
        return Lease(FileLock(tmp_path), str(tmp_path))

    lock = tmp_path / LOCK
    lock.write_text("{torn")  # a torn lock file: stale
    lease().acquire({})
    assert jsonlib.loads(lock.read_text())["pid"] == os.getpid()
    other = {"host": "node99", "pid": 4242, "job": "SLURM_JOB_ID=7", "time": 0}
    lock.write_text(jsonlib.dumps(other))  # another machine, this same job (a requeue)
    taken = lease()
    taken.acquire({"SLURM_JOB_ID": "7"})
    lock.write_text(jsonlib.dumps(other))  # another machine, another job: refused
    with pytest.raises(CheckpointError, match=r"in use by another live job: SLURM_JOB_ID=7 "
                       r"\(pid 4242 on node99"):  # fmt: skip
        lease().acquire({"SLURM_JOB_ID": "8"})
    taken.release()  # not ours any more: left alone
    assert jsonlib.loads(lock.read_text())["host"] == "node99" != socket.gethostname()


def test_a_manifest_that_is_not_ours_or_too_new_is_refused(run: Path) -> None:
    from nn_handler.checkpoint.manifest import read_manifest
    from nn_handler.checkpoint.verify import verify_files

    folder = run / SECOND
    (folder / MANIFEST).write_text('{"format": "other", "files": {}}')
    with pytest.raises(CheckpointError, match="is not an nn_handler manifest"):
        read_manifest(folder)
    (folder / MANIFEST).write_text('{"format": "nn_handler.manifest", "version": 9, "files": {}}')
    with pytest.raises(CheckpointError, match="format version 9; upgrade nn_handler"):
        read_manifest(folder)
    (folder / MANIFEST).write_text('{"format": "nn_handler.manifest", "version": 1, "files": {}}')
    with pytest.raises(CheckpointError, match=r"does not list \.metadata"):
        verify_files(folder)
    # A manifest naming a file outside its folder is refused before anything is read there.
    outside = '{"format": "nn_handler.manifest", "version": 1, "files": {"../x": {"size": 1}}}'
    (folder / MANIFEST).write_text(outside)
    with pytest.raises(CheckpointError, match=r"names '.*\.\./x', which is not its checkpoint"):
        read_manifest(folder)
    torn = '{"format": "nn_handler.manifest", "version": 1, "files": {"a": {"segments": 3}}}'
    (folder / MANIFEST).write_text(torn)
    with pytest.raises(CheckpointError, match=r"manifest\.json is not a readable manifest"):
        read_manifest(folder)


def test_another_folders_manifest_is_named_as_such_not_as_a_disk_error(run: Path) -> None:
    """Issue 69, item 22: a folder holding another checkpoint's manifest.json (copied by
    hand) was reported as '.metadata is corrupt (a disk or copy error)'. The message names
    the checkpoint the manifest was written for, and the fix; a renamed folder whose own
    manifest still matches its files loads (best/ holds its periodic checkpoint's)."""
    shutil.copy(run / FIRST / MANIFEST, run / SECOND / MANIFEST)
    with pytest.raises(CheckpointError) as caught:
        NNHandler.load(run / SECOND, mlp(), _adam)
    message = str(caught.value)
    assert f"its manifest.json was written for '{FIRST}'" in message, message
    assert "put back this folder's own manifest.json" in message
    assert "disk or copy error" not in message
    shutil.copytree(run / FIRST, run / "renamed")
    assert NNHandler.load(run / "renamed", mlp(), _adam).trainer.state.global_step == 5


def test_an_index_that_is_not_dcp_metadata_is_refused(tmp_path: Path) -> None:
    import pickle

    from nn_handler.checkpoint.safe_dcp import read_index

    index = tmp_path / ".metadata"
    index.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="holds a dict, not DCP Metadata"):
        read_index(index)
    index.write_bytes(b"\x80\x04\x95")  # torn
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_index(index)
