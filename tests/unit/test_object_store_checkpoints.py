"""Checkpoints on an object store, in one process, against a real S3 server (moto on
127.0.0.1, through s3fs): save and exact resume from a fresh machine, the commit protocol's
guarantees, and each failure named."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import HandlerConfig, NNHandler, TrainingPreempted
from nn_handler.checkpoint.manifest import SUFFIX, Manifest
from nn_handler.errors import CheckpointError, ConfigError
from tests import resume_helpers as rh
from tests.object_store import Bucket, s3, s3_server
from tests.training_helpers import regression_data

__all__ = ["s3", "s3_server"]  # fixtures


def machine(base: Path, name: str) -> str:
    """A machine's local working copy: a new name is a fresh machine with no local state."""
    return str(base / name)


def model(seed: int) -> nn.Module:
    """resume_helpers.model's network, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))


def run(url: str, staging: str, epochs: int, **kw: Any) -> dict[str, Any]:
    """A run; one that resumes starts from other weights (``seed`` 7): only the resume makes
    it end where the uninterrupted run does."""
    hooks = kw.pop("hooks", ())
    with NNHandler(
        model(7 if kw.get("resume") == "auto" else 0),
        rh.adam,
        nn.CrossEntropyLoss(),
        rh.step_lr,
        config=rh.config(url, 1, False, staging_dir=staging, **kw),  # type: ignore[arg-type]
        hooks=hooks,
    ) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=epochs)
        return rh.outcome(h)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with rh.handler(tmp_path_factory.mktemp("plain"), 1, False, None) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=rh.EPOCHS)
        return rh.outcome(h)


def objects(bucket: Bucket, prefix: str = "run") -> dict[str, int]:
    fs = bucket.fs()
    found = fs.find(f"{bucket.name}/{prefix}", detail=True)
    return {key.split(f"{prefix}/", 1)[1]: info["size"] for key, info in found.items()}


def test_resume_on_a_fresh_machine_is_bit_exact(
    s3: Bucket, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=1)
    stored = objects(s3)
    assert "latest.json" in stored
    committed = sorted(k for k in stored if k.endswith(SUFFIX))
    assert committed == ["ckpt-e0001-s00000005.pt" + SUFFIX]  # keep_last=1 rotated the rest
    latest = json.loads(s3.fs().cat(f"{s3.name}/run/latest.json"))
    assert latest["checkpoint"] == "ckpt-e0001-s00000005.pt"
    fresh = tmp_path / "second"
    resumed = run(url, str(fresh), epochs=rh.EPOCHS, resume="auto")
    assert rh.same(resumed, uninterrupted)
    assert (fresh / "ckpt-e0003-s00000015.pt").is_file()


def test_a_preempted_run_resumes_from_the_store(
    s3: Bucket, tmp_path: Path, uninterrupted: dict[str, Any], lines: list[str]
) -> None:
    url = f"{s3.url}/run"
    with pytest.raises(TrainingPreempted) as stop:
        run(url, machine(tmp_path, "spot"), rh.EPOCHS, hooks=[rh.SigtermAt(7)])
    assert stop.value.global_step == 7
    latest = json.loads(s3.fs().cat(f"{s3.name}/run/latest.json"))
    assert (latest["checkpoint"], latest["reason"]) == ("ckpt-e0001-s00000007.pt", "preempted")
    # The user is told where the emergency checkpoint lives, not the local working copy.
    emergency = f"{url}/ckpt-e0001-s00000007.pt"
    assert stop.value.checkpoint == emergency
    said = [line for line in lines if line.startswith("preempted after")]
    assert said == [f"preempted after optimizer step 7: exiting with status 75 (checkpoint "
                    f"{emergency})"]  # fmt: skip
    resumed = run(url, machine(tmp_path, "next"), rh.EPOCHS, resume="auto")
    assert f"resume='auto': resumed from {emergency}" in lines
    assert not [line for line in lines if str(tmp_path) in line]  # no local copy named
    assert rh.same(resumed, uninterrupted)


def test_a_preemption_whose_upload_fails_names_the_local_copy(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str]
) -> None:
    """The emergency checkpoint's background upload is refused: the user is told that only
    the local copy exists, and where, not a URL that holds nothing."""
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    put = RemoteStore.put

    def refusing(store: RemoteStore, local: Path, name: str) -> None:
        if "s00000007" in name:
            raise PermissionError(f"access denied to {name}")
        put(store, local, name)

    monkeypatch.setattr(RemoteStore, "put", refusing)
    url = f"{s3.url}/run"
    spot = machine(tmp_path, "spot")
    with pytest.raises(TrainingPreempted) as stop:
        run(url, spot, rh.EPOCHS, hooks=[rh.SigtermAt(7)], async_save=True)
    local = f"{spot}/ckpt-e0001-s00000007.pt"
    assert stop.value.checkpoint == local and Path(local).is_file()
    said = [line for line in lines if line.startswith("preempted after")]
    assert said == [f"preempted after optimizer step 7: exiting with status 75 (checkpoint "
                    f"{local}: a local copy only, its upload to {url} failed)"]  # fmt: skip
    marked = f"could not mark the latest checkpoint of {url} as preempted"
    assert any(line.startswith(marked) for line in lines)
    assert "ckpt-e0001-s00000007.pt" + SUFFIX not in objects(s3)  # never committed


def test_a_save_due_while_the_previous_upload_runs_waits_and_says_so(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str]
) -> None:
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    put = RemoteStore.put

    def slow(store: RemoteStore, local: Path, name: str) -> None:
        time.sleep(1.5)  # the network is slower than two steps
        put(store, local, name)

    monkeypatch.setattr(RemoteStore, "put", slow)
    run(f"{s3.url}/run", machine(tmp_path, "m"), epochs=1, async_save=True)
    waits = [line for line in lines if "for the previous one" in line]
    assert [w.split(":")[0] for w in waits] == ["checkpoint at step 4", "checkpoint at step 5"]
    assert all("still uploading in the background" in w for w in waits), waits


def test_sharded_saves_reach_the_store_only_from_the_runs_own_folder(
    s3: Bucket, tmp_path: Path
) -> None:
    """best/ written into the working copy (no periodic checkpoint to link: save_last off) is
    committed on the store; a folder saved elsewhere with save_checkpoint stays local."""
    url = f"{s3.url}/run"
    options = {"format": "sharded", "save_last": False, "save_best": True}
    config = rh.config(url, 1, False, staging_dir=machine(tmp_path, "m"), **options)  # type: ignore[arg-type]
    with NNHandler(model(0), rh.adam, nn.CrossEntropyLoss(), rh.step_lr, config=config) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=1)
        mine = h.trainer.save_checkpoint(tmp_path / "mine")
    assert (mine / "trainer.pt").is_file()
    stored = objects(s3)
    assert "best" + SUFFIX in stored and "best/trainer.pt" in stored, sorted(stored)
    assert not [key for key in stored if key.startswith("mine")], sorted(stored)


class Reads:
    """Counts, while on, the objects downloaded and the bytes checksummed (every checksum of a
    checkpoint goes through checkpoint/checksum.py's one zlib call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from nn_handler.checkpoint import checksum
        from nn_handler.checkpoint.store.remote_store import RemoteStore

        self.on = False
        self.fetched: list[str] = []
        self.checksummed = 0
        crc, get = checksum._crc32, RemoteStore.get

        def counting_crc(data: Any, value: int = 0) -> int:
            self.checksummed += len(data) if self.on else 0
            return crc(data, value)

        def counting_get(store: RemoteStore, name: str, local: Path, seen: Any) -> Any:
            if self.on:
                self.fetched.append(name)
            return get(store, name, local, seen)

        monkeypatch.setattr(checksum, "_crc32", counting_crc)
        monkeypatch.setattr(RemoteStore, "get", counting_get)


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_resume_from_the_store_fetches_and_checksums_each_byte_once(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=1, format=fmt)
    name = "ckpt-e0001-s00000005" + (".pt" if fmt == "file" else "")
    manifest = Manifest.from_bytes(s3.fs().cat(f"{s3.name}/run/{name}{SUFFIX}"), name)
    total = sum(entry["size"] for entry in manifest.objects.values())
    reads = Reads(monkeypatch)
    # Through the loop's resume (the folder's newest checkpoint), on a fresh machine...
    config = rh.config(url, 1, False, staging_dir=machine(tmp_path, "fresh"), format=fmt)  # type: ignore[arg-type]
    with NNHandler(model(3), rh.adam, nn.CrossEntropyLoss(), rh.step_lr, config=config) as h:
        reads.on = True
        h.resume("latest")
        reads.on = False
        assert h.trainer.state.global_step == 5
    assert sorted(reads.fetched) == sorted(manifest.objects)
    assert reads.checksummed == total
    # ... and through NNHandler.load of its URL, on another one.
    reads.fetched, reads.checksummed = [], 0
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another"))
    reads.on = True
    NNHandler.load(f"{url}/{name}", model(3)).close()
    reads.on = False
    assert sorted(reads.fetched) == sorted(manifest.objects)
    assert reads.checksummed == total


def test_a_corrupted_object_is_named_and_resume_falls_back(
    s3: Bucket, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=2, keep_last=2)
    fs = s3.fs()
    newest = f"{s3.name}/run/ckpt-e0002-s00000010.pt"
    data = bytearray(fs.cat(newest))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(newest, bytes(data))
    with pytest.raises(CheckpointError, match=r"the object ckpt-e0002-s00000010\.pt has"):
        NNHandler.load(f"{url}/ckpt-e0002-s00000010.pt", rh.model())
    resumed = run(url, machine(tmp_path, "second"), rh.EPOCHS, resume="auto", keep_last=2)
    assert rh.same(resumed, uninterrupted)  # from step 8's checkpoint, the same end


def test_a_missing_object_or_manifest_is_never_trusted(s3: Bucket, tmp_path: Path) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=2, keep_last=2)
    fs = s3.fs()
    fs.rm(f"{s3.name}/run/ckpt-e0002-s00000010.pt")
    with pytest.raises(CheckpointError, match=r"incomplete: the object ckpt-e0002-s00000010\.pt"):
        NNHandler.load(f"{url}/ckpt-e0002-s00000010.pt", rh.model())
    earlier = [k[: -len(SUFFIX)] for k in objects(s3) if k.endswith(SUFFIX) and "e0002" not in k]
    assert earlier == ["ckpt-e0001-s00000008.pt"]  # (step 10's save gave way to epoch 2's)
    fs.rm(f"{s3.name}/run/{earlier[0]}{SUFFIX}")  # as if its upload was killed before the commit
    with NNHandler(
        rh.model(), rh.adam, nn.CrossEntropyLoss(),
        config=rh.config(url, 1, False, staging_dir=machine(tmp_path, "third")),  # type: ignore[arg-type]
    ) as h:  # fmt: skip
        assert h.trainer.resume(missing_ok=True) is None  # neither is trusted: nothing to resume
    assert earlier[0] not in objects(s3)  # the uncommitted one was cleaned at the start


def test_a_missing_bucket_fails_before_training(s3: Bucket, tmp_path: Path) -> None:
    config = rh.config(f"s3://no-such-{s3.name}/run", 1, False, staging_dir=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(
        CheckpointError, match=r"the bucket of s3://no-such-my-bucket-[0-9a-f]+/run does not exist"
    ):
        NNHandler(rh.model(), rh.adam, nn.CrossEntropyLoss(), config=config)


def test_wrong_credentials_fail_before_training_and_are_not_shown(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    config = rh.config(f"{s3.url}/run", 1, False, staging_dir=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="access denied") as failure:
        NNHandler(rh.model(), rh.adam, nn.CrossEntropyLoss(), config=config)
    assert "AWS_ACCESS_KEY_ID" in str(failure.value)  # where credentials come from
    assert "not-the-secret" not in str(failure.value)


def test_storage_options_are_never_stored_in_a_checkpoint(s3: Bucket, tmp_path: Path) -> None:
    secret = s3.server.secret
    options = {"key": s3.server.key, "secret": secret}
    config = HandlerConfig.from_dict(
        {
            "checkpoint": {
                "dir": f"{s3.url}/run",
                "staging_dir": str(tmp_path),
                "storage_options": options,
            }
        }
    )
    assert secret not in repr(config) and secret not in json.dumps(config.model_dump(mode="json"))
    run(f"{s3.url}/run", machine(tmp_path, "m"), epochs=1, storage_options=options)
    for key in objects(s3):
        assert secret.encode() not in s3.fs().cat(f"{s3.name}/run/{key}")


def test_a_manifest_naming_a_path_outside_its_checkpoint_is_refused() -> None:
    forged = Manifest("ckpt-e0001-s00000005.pt", {"../../.bashrc": {"size": 1, "crc32": 0}})
    with pytest.raises(CheckpointError, match="not its checkpoint or a plain file in it"):
        Manifest.from_bytes(forged.to_bytes(), "s3://b/run/x.manifest.json")


def test_the_weights_of_a_remote_checkpoint_load_with_nnhandler_load(
    s3: Bucket, tmp_path: Path
) -> None:
    url = f"{s3.url}/run"
    trained = run(url, machine(tmp_path, "m"), epochs=1)
    loaded = NNHandler.load(f"{url}/ckpt-e0001-s00000005.pt", rh.model())
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, trained["model"][key])


def test_inspect_and_consolidate_take_urls(
    s3: Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nn_handler.cli import main

    url = f"{s3.url}/run"
    trained = run(url, machine(tmp_path, "m"), epochs=1, format="sharded")
    assert main(["checkpoint", "inspect", f"{url}/ckpt-e0001-s00000005"]) == 0
    shown = capsys.readouterr().out
    assert "epochs done 1" in shown and "sharded parts" in shown
    assert shown.startswith(f"{url}/ckpt-e0001-s00000005 (sharded: ")  # not the local copy
    assert main(["checkpoint", "inspect", url]) == 0  # a folder: its latest, by its URL
    assert capsys.readouterr().out.startswith(f"{url}/ckpt-e0001-s00000005 (sharded: ")
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", url, str(out)]) == 0  # a folder: its latest
    loaded = NNHandler.load(out, model(3))
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, trained["model"][key])
    assert main(["checkpoint", "inspect", f"{url}/ckpt-e0009-s00000099"]) == 1
    assert "no committed checkpoint at" in capsys.readouterr().err


def test_transient_errors_are_retried_and_permanent_ones_are_not(
    s3: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    store = RemoteStore(f"{s3.url}/run", first_wait_s=0.01)
    real, calls = store.fs.pipe_file, []

    def flaky(path: str, data: bytes, **kw: Any) -> Any:
        calls.append(path)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return real(path, data, **kw)

    monkeypatch.setattr(store.fs, "pipe_file", flaky)
    store.write("object", b"1")
    assert len(calls) == 3 and store.read("object") == b"1"
    refused: list[str] = []

    def refuse(path: str, data: bytes, **kw: Any) -> Any:
        refused.append(path)
        raise PermissionError("Access Denied")

    monkeypatch.setattr(store.fs, "pipe_file", refuse)
    with pytest.raises(CheckpointError, match="access denied"):
        store.write("other", b"1")
    assert len(refused) == 1  # retrying cannot fix refused credentials


def test_a_failed_background_upload_fails_the_next_save_and_keeps_latest(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "m"), epochs=1, async_save=True)
    before = s3.fs().cat(f"{s3.name}/run/latest.json")

    def refuse(self: RemoteStore, local: Path, name: str) -> None:
        raise CheckpointError(f"cannot upload {self.url_of(name)}: access denied (test)")

    monkeypatch.setattr(RemoteStore, "put", refuse)
    with pytest.raises(
        CheckpointError, match=r"uploading checkpoints to s3://my-bucket-[0-9a-f]+/run failed"
    ):
        run(url, machine(tmp_path, "m"), epochs=3, async_save=True, resume="auto")
    assert s3.fs().cat(f"{s3.name}/run/latest.json") == before


def test_best_and_top_k_are_committed_copies_and_dropped_ones_leave_the_store(
    s3: Bucket, tmp_path: Path
) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "m"), epochs=4, save_best=True, save_top_k=2, every_n_steps=None)
    stored = objects(s3)
    committed = sorted(k[: -len(SUFFIX)] for k in stored if k.endswith(SUFFIX))
    tops = [name for name in committed if name.startswith("top-")]
    assert "best.pt" in committed and len(tops) == 2, committed
    assert sorted(k for k in stored if k.startswith("top-") and not k.endswith(SUFFIX)) == tops
    best = json.loads(s3.fs().cat(f"{s3.name}/run/best.pt{SUFFIX}"))
    assert best["checkpoint"] == "best.pt" and list(best["objects"]) == ["best.pt"]
    loaded = NNHandler.load(f"{url}/best.pt", model(3))
    assert loaded.trainer.state.epoch >= 1


def test_save_to_a_url_uploads_and_commits_one_file(s3: Bucket, tmp_path: Path) -> None:
    with NNHandler(model(0), rh.adam, nn.CrossEntropyLoss()) as h:
        h.train(regression_data(), epochs=1)
        h.save(f"{s3.url}/exports/epoch1.pt")
        weights = {k: v.clone() for k, v in h.model.state_dict().items()}
    assert sorted(objects(s3, "exports")) == ["epoch1.pt", f"epoch1.pt{SUFFIX}"]
    loaded = NNHandler.load(f"{s3.url}/exports/epoch1.pt", model(3))
    for key, value in loaded.model.state_dict().items():
        assert torch.equal(value, weights[key])
    sharded = HandlerConfig.from_dict({"checkpoint": {"format": "sharded"}})
    with (
        NNHandler(model(0), rh.adam, nn.CrossEntropyLoss(), config=sharded) as h,
        pytest.raises(ConfigError, match="a sharded checkpoint reaches an object store"),
    ):
        h.save(f"{s3.url}/exports/sharded")


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_any_fsspec_url_works_the_same(
    scheme: str, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    url = f"file://{tmp_path}/store/run" if scheme == "file" else f"memory://{tmp_path.name}/run"
    run(url, machine(tmp_path, "first"), epochs=1)
    resumed = run(url, machine(tmp_path, "second"), rh.EPOCHS, resume="auto")
    assert rh.same(resumed, uninterrupted)
    if scheme == "file":
        assert (tmp_path / "store" / "run" / f"ckpt-e0003-s00000015.pt{SUFFIX}").is_file()


def test_resume_takes_a_folder_url_and_picks_its_latest(s3: Bucket, tmp_path: Path) -> None:
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "m"), epochs=2)
    elsewhere = rh.config(tmp_path / "local", 1, False)  # the same run settings, another dir
    with NNHandler(model(3), rh.adam, nn.CrossEntropyLoss(), config=elsewhere) as h:
        resumed = h.resume(url)
        assert resumed is not None and resumed.name == "ckpt-e0002-s00000010.pt"
        assert h.trainer.state.epoch == 2 and h.trainer.state.global_step == 10


def test_a_missing_object_in_a_bucket_named_bucket_is_just_missing(s3: Bucket) -> None:
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    assert "bucket" in s3.name  # a missing object's error names its path, bucket included
    store = RemoteStore(f"{s3.url}/run")
    assert store.read("latest.json") is None
    store.remove("never-written")  # missing is fine


def test_resume_from_a_url_whose_bucket_is_missing_names_it(s3: Bucket, tmp_path: Path) -> None:
    with (
        NNHandler(model(3), rh.adam, nn.CrossEntropyLoss()) as h,
        pytest.raises(CheckpointError, match=r"the bucket of s3://no-such-\S+ does not exist"),
    ):
        h.resume(f"s3://no-such-{s3.name}/run")


@pytest.mark.parametrize("damage", ["newer format", "one byte", "another checkpoint's"])
def test_a_manifest_that_cannot_be_read_never_gets_its_objects_deleted(
    s3: Bucket, tmp_path: Path, damage: str, lines: list[str]
) -> None:
    """A rolling upgrade (a newer nn_handler's ``"version": 3`` manifest), one bit of rot, or
    a readable manifest of another checkpoint copied over it (issue 69, item 18: the next
    start deleted the checkpoint's data as an interrupted upload): the next start skips that
    checkpoint, says so, and deletes none of its objects; only objects that no manifest names
    at all are an interrupted upload."""
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=2, keep_last=2)
    fs = s3.fs()
    key = f"{s3.name}/run/ckpt-e0002-s00000010.pt{SUFFIX}"
    data = fs.cat(key)
    if damage == "newer format":
        data = data.replace(b'"version": 2', b'"version": 3')
    elif damage == "another checkpoint's":
        data = fs.cat(f"{s3.name}/run/ckpt-e0001-s00000008.pt{SUFFIX}")
    else:
        data = data.replace(b'"objects"', b'"objectz"', 1)
    fs.pipe(key, data)
    fs.pipe(f"{s3.name}/run/ckpt-e0003-s00000015.pt", b"an upload killed before its commit")
    before = objects(s3)
    with NNHandler(
        rh.model(), rh.adam, nn.CrossEntropyLoss(),
        config=rh.config(url, 1, False, staging_dir=machine(tmp_path, "second")),  # type: ignore[arg-type]
    ) as h:  # fmt: skip
        resumed = h.trainer.resume(missing_ok=True)
    after = objects(s3)
    assert "ckpt-e0002-s00000010.pt" in after  # the data of the unreadable one is kept
    assert "ckpt-e0003-s00000015.pt" not in after  # the object no manifest names is gone
    assert set(before) - set(after) == {"ckpt-e0003-s00000015.pt"}
    assert resumed is not None and resumed.name == "ckpt-e0001-s00000008.pt"
    kept = [line for line in lines if "ckpt-e0002-s00000010.pt" + SUFFIX in line]
    assert kept and "its objects are kept" in kept[0]


def _retry_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("object store: cannot")]


def test_an_endpoint_that_never_answers_fails_the_start_after_bounded_retries(
    tmp_path: Path, lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TCP black hole on 127.0.0.1 (connections accepted, never answered): the start probe
    times out per request, tries twice with one warning, and fails with a CheckpointError
    naming the URL, instead of blocking NNHandler(...) for 5 tries of store_timeout_s (120 s
    by default: 10 minutes). The probe's own bound (20 s a try) is set to 0.3 s here, with
    the training's store_timeout_s left at its default: the probe does not use it."""
    from nn_handler.checkpoint.store import remote_store
    from tests.silent_proxy import SilentProxy

    monkeypatch.setattr(remote_store, "PROBE_TIMEOUT_S", 0.3)
    hole = SilentProxy(None)
    options = {"endpoint_url": hole.endpoint, "key": "k", "secret": "s"}
    url: Any = "s3://bucket/run"
    config = rh.config(url, 1, False, staging_dir=str(tmp_path), storage_options=options)
    assert config.checkpoint.store_timeout_s == 120.0
    probe = r"cannot write s3://bucket/run/\.nn_handler-probe-\d+: .*after 2 attempts"
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match=probe):
            NNHandler(rh.model(), rh.adam, nn.CrossEntropyLoss(), config=config)
    finally:
        hole.close()
    assert time.monotonic() - started < 60  # (120 s would be one request's timeout)
    retries = _retry_lines(lines)
    assert [line.split(" (attempt ")[1][:6] for line in retries] == ["1 of 2"]
    assert all("s3://bucket/run/.nn_handler-probe-" in line for line in retries)
    assert all("Timeout" in line for line in retries)


def test_a_store_that_refuses_connections_for_two_seconds_is_ridden_out(
    s3: Bucket, lines: list[str]
) -> None:
    """Issue 69, item 21: the 5 tries were spent in 0.5-1.3 s, so a store that refused
    connections for 2 s ended the job. With the default backoff (1, 2, 4, 8 s, plus up to
    half at random) a write to an endpoint that opens 2 s later succeeds, each retry said.
    (A second moto server, started late, serves the module's in-process S3 and its bucket.)"""
    import threading

    from moto.server import ThreadedMotoServer

    from nn_handler.checkpoint.store.remote_store import RemoteStore
    from tests.harness import free_port

    port = free_port()
    late = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    opener = threading.Timer(2.0, late.start)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": s3.server.key,
               "secret": s3.server.secret}  # fmt: skip
    store = RemoteStore(f"{s3.url}/late", options, timeout_s=5.0)
    opener.start()
    try:
        store.write("object", b"1")
        assert store.read("object") == b"1"
    finally:
        opener.join()
        late.stop()
    retries = _retry_lines(lines)
    assert 1 <= len(retries) <= 4 and all(f"{s3.url}/late/object" in line for line in retries)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_store_that_falls_silent_mid_run_fails_the_save_not_the_run_silently(
    s3: Bucket, tmp_path: Path, lines: list[str], async_save: bool
) -> None:
    """The store answers at the start, then falls silent at step 4 (checkpoints every 2
    steps): a synchronous save fails at step 4 with a CheckpointError after its retries;
    with async_save the loop goes on, and the failure surfaces when the next save (step 6)
    must wait for the upload."""
    from tests.silent_proxy import SilentProxy

    proxy = SilentProxy(int(s3.server.endpoint.rsplit(":", 1)[1]))

    class FallSilent(rh.Hook):
        def after_step(self) -> None:
            if self.trainer.state.global_step == 4:
                proxy.silent = True

    options = {"endpoint_url": proxy.endpoint}
    url: Any = f"{s3.url}/run"
    config = rh.config(url, 1, False, staging_dir=str(tmp_path), storage_options=options,
                       store_timeout_s=0.3, store_retry_wait_s=0.05,
                       async_save=async_save)  # fmt: skip
    try:
        with NNHandler(
            rh.model(), rh.adam, nn.CrossEntropyLoss(), config=config, hooks=[FallSilent()]
        ) as h:  # fmt: skip
            with pytest.raises(CheckpointError, match=r"after 5 attempts") as failed:
                h.train(regression_data(), epochs=3)
            reached = h.trainer.state.global_step
    finally:
        proxy.close()
    text = str(failed.value)
    assert "ReadTimeoutError" in text
    if async_save:
        # Step 2's upload (its objects, then latest.json) may still be running when the store
        # falls silent (on a loaded machine it was reading latest.json): then the save of
        # step 4 waits for it and raises; else step 4's upload fails and step 6's save raises.
        named = re.search(rf"{s3.url}/run/(ckpt-e0000-s0000000[24]\.pt|latest\.json)", text)
        assert named, text
        assert reached == (6 if "s00000004" in named.group(0) else 4)
    else:
        named = re.search(rf"{s3.url}/run/ckpt-e0000-s00000004\.pt", text)
        assert named, text
        assert reached == 4
    saves = [line for line in _retry_lines(lines) if named.group(0) in line]
    assert len(saves) == 4  # the close's release of the lock tries once, without retries
    assert all(f"{s3.url}/run/" in line for line in _retry_lines(lines))


def test_a_fresh_start_on_restart_never_becomes_the_latest_over_committed_checkpoints(
    s3: Bucket, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """The default resume (on_restart) on a fresh machine, not a restart, over a bucket that
    holds the run's checkpoints: a ConfigError naming both choices, before any step, and
    latest.json untouched; resume: never starts a new run over them; resume: auto continues
    the long run."""
    url = f"{s3.url}/run"
    run(url, machine(tmp_path, "first"), epochs=2)
    latest = s3.fs().cat(f"{s3.name}/run/latest.json")
    with pytest.raises(ConfigError, match=r"resume: auto to continue.*resume: never to start"):
        run(url, machine(tmp_path, "second"), epochs=1, resume="on_restart")
    assert s3.fs().cat(f"{s3.name}/run/latest.json") == latest
    resumed = run(url, machine(tmp_path, "third"), epochs=rh.EPOCHS, resume="auto")
    assert rh.same(resumed, uninterrupted)
    fresh = run(url, machine(tmp_path, "fourth"), epochs=1, resume="never")
    assert fresh["global_step"] == 5  # an explicit choice: a new run over the old one


def _holder(**fields: Any) -> bytes:
    return json.dumps({"host": "node-b", "pid": 4242, "job": None, "time": time.time(),
                       "lease_s": 120.0, **fields}).encode()  # fmt: skip


def test_a_live_job_holds_its_bucket_folder_by_a_conditional_write(
    s3: Bucket, tmp_path: Path, lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs in one bucket folder (no local lock can see both): the second start is a
    CheckpointError naming the holder, before it deletes anything; a lease that ran out or
    an earlier start of the same job is taken over with a warning; the lock goes at close."""
    url = f"{s3.url}/run"
    lock = f"{s3.name}/run/.nn_handler.lock"
    fs = s3.fs()
    fs.pipe(lock, _holder())  # a job on another machine, renewed just now
    fs.pipe(f"{s3.name}/run/ckpt-e0001-s00000005.pt", b"its upload in flight")
    refused = r"in use by another live job: a job \(pid 4242 on node-b"
    with pytest.raises(CheckpointError, match=refused):
        run(url, machine(tmp_path, "second"), epochs=1)
    assert fs.exists(f"{s3.name}/run/ckpt-e0001-s00000005.pt")  # nothing deleted
    fs.pipe(lock, _holder(lease_s=0.5))  # a job with a short lease, killed after renewing
    time.sleep(1.0)  # its lease runs out, by the store's clock
    run(url, machine(tmp_path, "third"), epochs=1)
    assert any("taking over the lock of a job (pid 4242 on node-b): its lease ran out" in line
               for line in lines)  # fmt: skip
    assert not fs.exists(lock)  # released at close
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    fs.pipe(lock, _holder(job="SLURM_JOB_ID=77"))  # the same job, requeued on another node
    run(url, machine(tmp_path, "fourth"), epochs=1, resume="auto")
    assert any("an earlier start of this same job" in line for line in lines)


def test_a_lease_does_not_depend_on_the_machines_clocks(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 69, item 20 (a fault campaign's partial): a second job whose clock ran 300 s
    ahead took a live job's S3 lease (even on the same host) and deleted its upload in
    flight. The lease's age is the store's (the lock object's time against a probe's, both
    the store's clock), and a live process on this host holds its lock whatever the times."""
    from nn_handler.checkpoint.store import lease as lease_module

    url = f"{s3.url}/run"
    lock = f"{s3.name}/run/.nn_handler.lock"
    fs = s3.fs()
    fs.pipe(lock, _holder())  # a live job on another machine, renewed just now
    fs.pipe(f"{s3.name}/run/ckpt-e0001-s00000005.pt", b"its upload in flight")
    real = time.time
    monkeypatch.setattr(lease_module.time, "time", lambda: real() + 300.0)  # a clock ahead
    with pytest.raises(CheckpointError, match=r"in use by another live job"):
        run(url, machine(tmp_path, "ahead"), epochs=1)
    assert fs.exists(f"{s3.name}/run/ckpt-e0001-s00000005.pt")  # nothing deleted
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a live process on this host, its renewal long ago by any clock
        fs.pipe(lock, _holder(host=socket.gethostname(), pid=alive.pid, lease_s=0.1))
        time.sleep(0.5)
        with pytest.raises(CheckpointError, match=rf"pid {alive.pid} on {socket.gethostname()}"):
            run(url, machine(tmp_path, "same-host"), epochs=1)
    finally:
        alive.kill()
        alive.wait()


def test_a_job_whose_lock_was_taken_over_writes_nothing_more(tmp_path: Path) -> None:
    """A holder that lost its lease (another job took the lock over) notices at its next
    renewal, says so once, and every later change to the store is refused with the reason."""
    from nn_handler.checkpoint.store.lease import Lease, ObjectLock
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    store = RemoteStore(f"memory://{tmp_path.name}/taken")
    held = Lease(ObjectLock(store), store.url, lease_s=0.4)
    held.acquire({})
    store.write(".nn_handler.lock", _holder(job="SLURM_JOB_ID=9"))  # another job took it
    deadline = time.monotonic() + 5
    while held.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.lost is not None and "SLURM_JOB_ID=9 (pid 4242 on node-b)" in held.lost
    with pytest.raises(CheckpointError, match=r"is no longer this job's: SLURM_JOB_ID=9"):
        held.check_held()
    held.release()
    assert json.loads(store.read(".nn_handler.lock") or b"{}")["pid"] == 4242  # theirs kept


def test_the_lease_is_renewed_while_the_job_lives(tmp_path: Path) -> None:
    from nn_handler.checkpoint.store.lease import Lease, ObjectLock
    from nn_handler.checkpoint.store.remote_store import RemoteStore

    store = RemoteStore(f"memory://{tmp_path.name}/run")
    held = Lease(ObjectLock(store), store.url, lease_s=0.4)
    held.acquire({})
    first = json.loads(store.read(".nn_handler.lock") or b"{}")["time"]
    time.sleep(0.5)
    assert json.loads(store.read(".nn_handler.lock") or b"{}")["time"] > first
    held.release()
    assert store.read(".nn_handler.lock") is None
    store.write(".nn_handler.lock", b"not json")  # no holder can be named: stale
    taken = Lease(ObjectLock(store), store.url, lease_s=0.4)
    taken.acquire({})
    assert json.loads(store.read(".nn_handler.lock") or b"{}")["pid"] == os.getpid()
    taken.release()


def test_a_large_object_goes_up_in_parallel_parts(
    s3: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads are s3fs's put_file: an object of two chunks or more is a multipart upload
    whose parts go up several at once (s3fs's max_concurrency, 10 by default), not a loop of
    our own. The chunk is made 5 MiB (S3's smallest part) so that 12 MiB is three parts."""
    import s3fs.core

    from nn_handler.checkpoint.store.remote_store import RemoteStore

    monkeypatch.setattr(s3fs.core, "calculate_chunksize", lambda size, chunksize=None: 5 << 20)
    store = RemoteStore(f"{s3.url}/run")
    assert store.fs.max_concurrency > 1
    parts: list[int] = []
    concurrent = store.fs._upload_file_part_concurrent

    async def counting(*args: Any, **kwargs: Any) -> Any:
        out = await concurrent(*args, **kwargs)
        parts.append(len(out))
        return out

    monkeypatch.setattr(store.fs, "_upload_file_part_concurrent", counting)
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(12 << 20))
    store.put(local, "big.bin")
    assert parts == [3]
    assert s3.fs().cat(f"{s3.name}/run/big.bin") == local.read_bytes()
