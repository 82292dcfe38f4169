"""The object-store commit protocol's error paths (ObjectStore), on fsspec's in-memory store (no
server): manifests that are not trusted, names that do not match, URLs that name no
checkpoint, schemes nobody installed."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from nn_handler.checkpoint.manifest import SUFFIX, Manifest
from nn_handler.checkpoint.opening import open_checkpoint
from nn_handler.checkpoint.store import remote_protocol as protocol
from nn_handler.checkpoint.store.object_store import ObjectStore
from nn_handler.checkpoint.store.remote_store import RemoteStore
from nn_handler.checkpoint.store.urls import store_of
from nn_handler.cli import main
from nn_handler.config import CheckpointConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import CheckpointError, ConfigError
from tests.training_helpers import save_folder


def _commit_file(store: ObjectStore, name: str, value: torch.Tensor, run: str) -> None:
    """Write and commit the single-file checkpoint ``name`` holding ``{"w": value}``."""
    target = store.dir / name
    staging = store.staging(target)
    staging.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": value}, staging)
    store.commit(target, staging, run)


def _names(store: ObjectStore) -> list[str]:
    """What a reader of the store finds committed."""
    store.flush()
    reader = ObjectStore(CheckpointConfig(dir=store.where, staging_dir=f"{store.dir}-reader"))
    return [path.name for path in reader.checkpoints()]  # outside a session: read afresh


@pytest.fixture
def folder(tmp_path: Path) -> ObjectStore:
    """A folder on the in-memory store holding one committed checkpoint, top-ckpt.pt."""
    store = _object_store(tmp_path)
    _commit_file(store, "top-ckpt.pt", torch.ones(3), run="r1")
    return store


def test_a_committed_checkpoint_is_listed_with_its_run_and_fetched(folder: ObjectStore) -> None:
    assert (
        _names(folder) == ["top-ckpt.pt"]
        and folder.checkpoints()[folder.dir / "top-ckpt.pt"] == "r1"
    )
    assert torch.equal(torch.load(folder.fetch("top-ckpt.pt"))["w"], torch.ones(3))


def test_an_unreadable_or_foreign_manifest_is_not_trusted(folder: ObjectStore) -> None:
    from loguru import logger

    messages: list[str] = []
    logger.enable("nn_handler")  # the library's lines are off unless logging is enabled
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        folder.store.write(f"torn.pt{SUFFIX}", b'{"format": "nn_handler.man')
        folder.store.write(f"other.pt{SUFFIX}", b'{"format": "something else", "objects": {}}')
        newer = Manifest("top-newer.pt", {"top-newer.pt": {"size": 1, "crc32": 0}}).to_bytes()
        folder.store.write(f"top-newer.pt{SUFFIX}", newer.replace(b'"version": 2', b'"version": 9'))
        assert _names(folder) == ["top-ckpt.pt"]
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    text = "".join(messages)
    assert "torn.pt.manifest.json is not a readable checkpoint manifest" in text
    assert "other.pt.manifest.json is not an nn_handler checkpoint manifest" in text
    assert "top-newer.pt.manifest.json has a newer format; upgrade nn_handler" in text


def test_a_manifest_that_describes_another_checkpoint_is_refused(folder: ObjectStore) -> None:
    data = folder.store.read(f"top-ckpt.pt{SUFFIX}")
    assert data is not None
    folder.store.write(f"copy.pt{SUFFIX}", data)
    with pytest.raises(CheckpointError, match=r"describes 'top-ckpt\.pt', not 'copy\.pt'"):
        folder.fetch("copy.pt")


def test_a_manifest_of_another_checkpoint_deletes_nothing_at_the_next_start(
    folder: ObjectStore, tmp_path: Path, lines: list[str]
) -> None:
    """Issue 69, item 18 (a fault campaign's break): a readable manifest under an older
    checkpoint's name that describes another one (copied over it by hand) made the next
    start delete the older checkpoint's data as "an upload interrupted before its commit".
    Now that manifest is not trusted, the next start deletes none of its objects and says so
    in one line; a manifest listing objects outside its own checkpoint is refused alike."""
    _commit_file(folder, "top-newer.pt", torch.zeros(3), run="r1")
    newer = folder.store.read(f"top-newer.pt{SUFFIX}")
    assert newer is not None
    folder.store.write(
        f"top-ckpt.pt{SUFFIX}", newer
    )  # top-ckpt.pt's manifest now describes top-newer.pt
    outside = Manifest(
        "top-odd.pt",
        {"top-odd.pt": {"size": 1, "crc32": 0}, "top-ckpt.pt": {"size": 1, "crc32": 0}},
    )
    folder.store.write("top-odd.pt", b"x")
    folder.store.write(f"top-odd.pt{SUFFIX}", outside.to_bytes())
    again = ObjectStore(CheckpointConfig(dir=folder.where, staging_dir=str(tmp_path / "again")))
    with again.session(lead=True):
        listing = again.store.listing()
        assert "top-ckpt.pt" in listing and "top-odd.pt" in listing, listing  # nothing deleted
        assert not [line for line in lines if "interrupted before its commit" in line], lines
        assert any("top-ckpt.pt.manifest.json describes 'top-newer.pt', not 'top-ckpt.pt'" in line
                   and "its objects are kept" in line for line in lines), lines  # fmt: skip
        assert any(
            "top-odd.pt.manifest.json names 'top-ckpt.pt', which is not its" in line
            for line in lines
        )
        assert [path.name for path in again.checkpoints()] == ["top-newer.pt"]
        with pytest.raises(CheckpointError, match=r"describes 'top-newer\.pt', not 'top-ckpt\.pt'"):
            again.fetch("top-ckpt.pt")


def test_an_uncommitted_checkpoint_is_not_fetched(folder: ObjectStore) -> None:
    folder.store.write("top-half.pt", b"bytes of an upload killed before its manifest")
    with pytest.raises(CheckpointError, match=r"top-half\.pt is not committed"):
        folder.fetch("top-half.pt")
    known, listing = protocol.read_manifests(folder.store)
    assert protocol.incomplete(listing, known, lambda n: n.endswith(".pt")) == ["top-half.pt"]


def test_urls_that_name_no_checkpoint_are_clear_errors(folder: ObjectStore) -> None:
    with pytest.raises(CheckpointError, match=r"no committed checkpoint at .*missing\.pt"):
        open_checkpoint(f"{folder.where}/missing.pt")
    with pytest.raises(CheckpointError, match="names no checkpoint inside a folder"):
        store_of("memory://")
    assert main(["checkpoint", "consolidate", f"{folder.where}/top-ckpt.pt", "s3://b/x.pt"]) == 1


def test_a_scheme_without_its_filesystem_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.dir nosuchscheme://bucket/run"):
        RemoteStore("nosuchscheme://bucket/run")


def test_a_deleted_checkpoint_loses_its_manifest_first(folder: ObjectStore) -> None:
    order: list[str] = []
    real = folder.store.remove
    folder.store.remove = lambda name: (order.append(name), real(name))[1]  # type: ignore[method-assign]
    folder.remove(folder.dir / "top-ckpt.pt")
    assert order == [f"top-ckpt.pt{SUFFIX}", "top-ckpt.pt"]
    assert folder.store.listing() == {}
    assert not (folder.dir / "top-ckpt.pt").exists()


def test_the_default_working_copy_stays_inside_the_cache() -> None:
    from nn_handler.checkpoint.store.object_store import default_working_copy

    cache = Path("/cache")
    root = cache / "nn_handler" / "checkpoints"
    assert default_working_copy("s3://bucket/run", {"XDG_CACHE_HOME": "/cache"}) == (
        root / "s3_" / "bucket" / "run"
    )
    tricky = default_working_copy("s3://bucket/../../../etc", {"XDG_CACHE_HOME": "/cache"})
    assert tricky == root / "s3_" / "bucket" / "_" / "_" / "_" / "etc"


def test_a_copy_of_an_uncommitted_checkpoint_is_an_error(folder: ObjectStore) -> None:
    with pytest.raises(CheckpointError, match=r"cannot copy memory://\w+/run/missing\.pt"):
        folder.commit(folder.dir / "best.pt", "missing.pt", None)
    folder.commit(folder.dir / "best.pt", "top-ckpt.pt", "r1")  # it goes on after a failure
    assert _names(folder) == ["best.pt", "top-ckpt.pt"]


class NoCredentialsError(Exception):
    """What botocore raises when it finds no credentials anywhere."""


@pytest.mark.parametrize(
    ("error", "tries", "says"),
    [
        # A transient error that lasts fails once the retries are spent.
        (ConnectionResetError("connection reset by peer"), 3, r"Reset.*\(after 3 attempts\)"),
        # Missing credentials are named as such, at once: retrying cannot find them.
        (NoCredentialsError("Unable to locate credentials"), 1, r"access denied .*standard"),
    ],
)
def test_store_errors_are_retried_only_when_retrying_can_help(
    error: Exception, tries: int, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RemoteStore(f"memory://{uuid.uuid4().hex}/run", attempts=3, first_wait_s=0.001)
    calls: list[str] = []

    def failing(path: str, data: bytes, **kw: object) -> None:
        calls.append(path)
        raise error

    monkeypatch.setattr(store.fs, "pipe_file", failing)
    with pytest.raises(CheckpointError, match=says):
        store.write("object", b"1")
    assert len(calls) == tries


def test_a_folder_that_cannot_be_made_is_a_checkpoint_error(tmp_path: Path) -> None:
    from nn_handler.checkpoint.manager import CheckpointManager
    from nn_handler.config import CheckpointConfig

    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    with pytest.raises(CheckpointError, match="cannot use the checkpoint folder"):
        CheckpointManager(CheckpointConfig(dir=str(taken / "run")), NullCommunicator())


def test_a_memory_url_shared_by_several_ranks_is_a_config_error() -> None:
    from types import SimpleNamespace

    from nn_handler.checkpoint.manager import CheckpointManager
    from nn_handler.config import CheckpointConfig

    two_ranks = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(ConfigError, match="memory:// is one process's memory"):
        CheckpointManager(CheckpointConfig(dir="memory://bucket/run"), two_ranks)  # type: ignore[arg-type]


def _object_store(tmp_path: Path) -> ObjectStore:
    """An ObjectStore on a fresh memory:// folder, its working copy under ``tmp_path``."""
    url = f"memory://{uuid.uuid4().hex}/run"
    return ObjectStore(CheckpointConfig(dir=url, staging_dir=str(tmp_path / "copy")))


def _killed_before_the_commit(store: RemoteStore, manifest: Manifest) -> None:
    raise CheckpointError("killed between the upload and the commit")


def test_a_checkpoint_written_again_loses_its_old_manifest_before_its_objects(
    folder: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run resumed before a checkpoint that its killed predecessor committed writes that
    name anew (other bytes); killed between its upload and its commit, the old manifest must
    not vouch for the new object (the upload-kill campaign found one that did)."""
    monkeypatch.setattr(protocol, "commit", _killed_before_the_commit)
    with pytest.raises(CheckpointError, match="killed between"):
        _commit_file(folder, "top-ckpt.pt", torch.zeros(3), run="r1")
    with pytest.raises(CheckpointError, match=r"top-ckpt\.pt is not committed"):
        folder.fetch("top-ckpt.pt")
    monkeypatch.undo()
    _commit_file(folder, "top-ckpt.pt", torch.zeros(3), run="r1")  # the next save commits it
    assert torch.equal(torch.load(folder.fetch("top-ckpt.pt"))["w"], torch.zeros(3))


def test_a_sharded_checkpoint_written_again_loses_its_old_manifest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _object_store(tmp_path)
    target = store.dir / "ckpt-e0000-s00000008"
    with store.session(lead=True):  # the lead drops an old commit before writing anew
        save_folder(store, target, {"format": "x"}, {"model": {"w": torch.ones(2)}})
        assert _names(store) == [target.name]
        monkeypatch.setattr(protocol, "commit", _killed_before_the_commit)
        with pytest.raises(CheckpointError, match="killed between"):
            save_folder(store, target, {"format": "x"}, {"model": {"w": torch.zeros(2)}})
        assert _names(store) == []  # never trusted with the new shards under the old manifest
        assert target not in store.checkpoints()  # nor by the lead


def test_a_sharded_checkpoint_with_an_unreadable_manifest_keeps_every_object(
    tmp_path: Path,
) -> None:
    """Only objects that no manifest names at all are an interrupted upload; a folder whose
    manifest cannot be read (or a replaced folder's leftover beside a readable one) is told
    apart."""
    store = _object_store(tmp_path)
    for step in (8, 16):
        target = store.dir / f"ckpt-e0000-s{step:08d}"
        save_folder(store, target, {"format": "x"}, {"model": {"w": torch.ones(2)}})
    store.store.write("ckpt-e0000-s00000008/leftover", b"not in its readable manifest")
    store.store.write("ckpt-e0000-s00000024/__0_0.distcp", b"no manifest names it")
    damaged = f"ckpt-e0000-s00000016{SUFFIX}"
    data = store.store.read(damaged)
    assert data is not None
    store.store.write(damaged, data[:-3])  # torn: not JSON any more
    before = set(store.store.listing())
    with store.session(lead=True):
        removed = before - set(store.store.listing())
        assert removed == {"ckpt-e0000-s00000008/leftover", "ckpt-e0000-s00000024/__0_0.distcp"}
        assert set(store.store.listing()) == (before | {".nn_handler.lock"}) - removed
        assert any(k.startswith("ckpt-e0000-s00000016/") for k in store.store.listing())
