"""The commit protocol's contract, run against both CheckpointStore implementations (a local
folder and an object store, fsspec's in-memory one): a checkpoint written into the staging
place is trusted only once committed, with one manifest format; a kill between the puts and
the commit leaves nothing trusted and nothing behind; a changed byte is named when the
checkpoint is opened; a manifest that cannot be read gets nothing deleted."""

from __future__ import annotations

import re
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nn_handler.checkpoint.manifest import MANIFEST, Manifest, manifest_name, read_manifest
from nn_handler.checkpoint.naming import is_checkpoint_name
from nn_handler.checkpoint.opening import read
from nn_handler.checkpoint.run_identity import RUN
from nn_handler.checkpoint.saving import SaveRoute
from nn_handler.checkpoint.sharded import ShardedWriter
from nn_handler.checkpoint.store import CheckpointStore, LocalStore
from nn_handler.checkpoint.store.object_store import ObjectStore
from nn_handler.config import CheckpointConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import CheckpointError
from tests.training_helpers import save_folder

FILE, FOLDER = "ckpt-e0001-s00000005.pt", "ckpt-e0002-s00000010"
WEIGHTS = torch.arange(4096, dtype=torch.float32)


def _open_store(kind: str, tmp_path: Path, copy: str = "copy") -> CheckpointStore:
    if kind == "local":
        return LocalStore(tmp_path / "run")
    url = f"memory://{tmp_path.name}-{uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path)).hex}/run"
    return ObjectStore(CheckpointConfig(dir=url, staging_dir=str(tmp_path / copy)))


@pytest.fixture(params=["local", "object store"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path) -> Iterator[CheckpointStore]:
    opened = _open_store(kind, tmp_path)
    assert opened.start(is_checkpoint_name) is None
    yield opened
    opened.release()


def _restart(kind: str, tmp_path: Path, old: CheckpointStore, copy: str) -> CheckpointStore:
    """The store as the next job's rank 0 finds it (a fresh working copy for an object
    store: another machine)."""
    old.release()
    fresh = _open_store(kind, tmp_path, copy)
    assert fresh.start(is_checkpoint_name) is None
    return fresh


def _write_file(store: CheckpointStore, name: str = FILE, commit: bool = True) -> Path:
    target = store.dir / name
    staging = store.staging(target)
    staging.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"w": WEIGHTS, RUN: {"id": "run-1"}}, staging)  # the run the store records
    if commit:
        store.commit(target, staging, "run-1")
    return target


def _write_folder(store: CheckpointStore) -> Path:
    rest = {"format": "x", "n": 1, RUN: {"id": "run-1"}}  # the run the manifest names
    return save_folder(store, store.dir / FOLDER, rest, {"model": {"w": WEIGHTS}})


def test_a_committed_file_and_folder_are_trusted_and_open(store: CheckpointStore) -> None:
    file, folder = _write_file(store), _write_folder(store)
    store.flush()
    assert store.start(is_checkpoint_name, lead=False) is None  # as a reader finds it
    assert [p.name for p in store.checkpoints()] == [FILE, FOLDER]
    assert store.checkpoints() == {file: "run-1", folder: "run-1"}  # the run that wrote each
    assert torch.equal(read(file, store=store).contents["w"], WEIGHTS)
    opened = read(folder, store=store)
    assert opened.folder is not None and opened.contents["n"] == 1
    local = read_manifest(folder)  # one format, inside a local folder...
    assert local is not None and local.run == "run-1"
    assert set(local.files()) == {"__0_0.distcp", ".metadata", "trainer.pt"}
    if isinstance(store, ObjectStore):  # ... and beside each checkpoint on the store
        for name in (FILE, FOLDER):
            data = store.store.read(manifest_name(name))
            assert data is not None and Manifest.from_bytes(data, name).name == name
        remote = Manifest.from_bytes(store.store.read(manifest_name(FOLDER)) or b"", FOLDER)
        assert remote.objects == local.objects  # the same manifest in both places
        shard = remote.objects[f"{FOLDER}/__0_0.distcp"]
        assert shard["segments"][0][3] == "model.w"  # checked by item as it downloads
        assert opened.where.startswith("memory://") and opened.verified


def test_a_kill_between_the_puts_and_the_commit_leaves_nothing_trusted(
    kind: str, store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_file(store, commit=False)  # written, never committed
    monkeypatch.setattr(type(store), "commit", _killed)
    with pytest.raises(CheckpointError, match="killed before the commit"):
        _write_folder(store)  # every rank's files put, then killed
    monkeypatch.undo()
    fresh = _restart(kind, tmp_path, store, "copy-2")
    try:
        assert fresh.checkpoints() == {}
        left = sorted(p.name for p in fresh.dir.iterdir() if p.name.startswith("."))
        assert left == [".nn_handler.lock"]  # the staging file and folder are gone
        if isinstance(fresh, ObjectStore):
            assert [k for k in fresh.store.listing() if k.startswith("ckpt")] == []
    finally:
        fresh.release()


def _killed(*args: object, **kwargs: object) -> None:
    raise CheckpointError("killed before the commit")


def test_a_changed_byte_is_named_when_the_checkpoint_is_opened(
    kind: str, store: CheckpointStore, tmp_path: Path
) -> None:
    target = _write_file(store)
    store.flush()
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    if isinstance(store, ObjectStore):
        store.store.write(FILE, bytes(data))  # rot on the store; a fresh machine opens it
        store = _restart(kind, tmp_path, store, "copy-2")
    else:
        target.write_bytes(bytes(data))
    try:
        with pytest.raises(CheckpointError, match=rf"{FILE}.* is corrupt|corrupt: .*{FILE}"):
            read(store.dir / FILE, store=store)
    finally:
        store.release()


def test_an_unreadable_manifest_gets_nothing_deleted(
    kind: str, store: CheckpointStore, tmp_path: Path
) -> None:
    folder = _write_folder(store)
    store.flush()
    if isinstance(store, ObjectStore):
        before = set(store.store.listing())
        store.store.write(manifest_name(FOLDER), b'{"format": "nn_handler.manifest", "ver')
    else:
        before = {p.name for p in folder.iterdir()}
        (folder / MANIFEST).write_bytes(b'{"format": "nn_handler.manifest", "ver')
    fresh = _restart(kind, tmp_path, store, "copy-2")
    try:
        if isinstance(fresh, ObjectStore):
            assert before <= set(fresh.store.listing()) and fresh.checkpoints() == {}
        else:
            assert {p.name for p in folder.iterdir()} == before
            with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable"):
                read_manifest(folder)
    finally:
        fresh.release()


def test_each_byte_of_a_folder_save_is_checksummed_once(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards' items as they pass to their files, the other files once at the commit:
    nothing is read back to be checksummed (every CRC-32 goes through checksum._crc32)."""
    from nn_handler.checkpoint import checksum

    counted = [0]
    real = checksum._crc32

    def counting(data: Any, value: int = 0) -> int:
        counted[0] += len(data)
        return real(data, value)

    monkeypatch.setattr(checksum, "_crc32", counting)
    folder = _write_folder(store)
    store.flush()
    written = sum(p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST)
    assert counted[0] == written


def _flip_near_the_end(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[-100] ^= 0x01  # inside the tensor's bytes, near the end of the file
    return bytes(changed)


def _first_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_flip_near_the_end, r"__0_0\.distcp bytes 0-\d+ \(model\.w\)"),
        (_first_half, r"__0_0\.distcp has \d+ bytes"),
    ],
)
def test_a_damaged_shard_on_the_store_is_named_as_it_arrives(
    tmp_path: Path, damage: Any, named: str
) -> None:
    """A shard's manifest entry holds its items' CRC-32s (never read back when written): a
    download is checked item by item as it arrives, the item (or the short size) named."""
    store = _open_store("object store", tmp_path)
    assert store.start(is_checkpoint_name) is None
    _write_folder(store)
    assert isinstance(store, ObjectStore)
    key = f"{FOLDER}/__0_0.distcp"
    store.store.write(key, damage(store.store.read(key) or b""))
    fresh = _restart("object store", tmp_path, store, "copy-2")
    try:
        with pytest.raises(CheckpointError, match=named):
            read(FOLDER, store=fresh)
    finally:
        fresh.release()


def test_an_item_the_stream_did_not_see_is_read_back(tmp_path: Path) -> None:
    """The checksums taken as the items pass equal the ones read back from the file, and a
    span the stream did not see (a writer that never asked tell()) is read back."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter, checksum_results
    from nn_handler.checkpoint.sharded import dcp_save

    state = {"model": {"w": WEIGHTS, "b": torch.ones(3)}, "step": 7}
    seen: list[Any] = []
    real = FileSystemWriter.write_data

    def keep(self: Any, plan: Any, planner: Any) -> Any:
        results = real(self, plan, planner)
        seen.extend(results.wait())
        return results

    writer = ChecksummingWriter(str(tmp_path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FileSystemWriter, "write_data", keep)
        dcp_save(state, writer, {"process_group": None, "no_dist": True})
    as_written = checksum_results(tmp_path, seen, writer.streams.seen)
    read_back = checksum_results(tmp_path, seen, {})
    # The oracle: zlib's CRC-32 of each item's bytes in its file, not the code's own read-back.
    expected = []
    for result in seen:
        info = result.storage_data
        data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert len(data) == info.length
        expected.append(zlib.crc32(data))
    assert len(expected) >= 3 and len(set(expected)) == len(expected)
    assert [result.storage_data.crc32 for result in as_written] == expected
    assert [result.storage_data.crc32 for result in read_back] == expected


def test_a_name_written_again_loses_its_old_manifest_first_and_a_new_one_costs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a checkpoint is written under a name the store has committed (a run resumed
    before a checkpoint that its killed predecessor committed), that name's manifest is
    deleted, so that it never vouches for new objects; a name never committed (every
    periodic one) costs no request to the store."""
    store = _open_store("object store", tmp_path)
    assert isinstance(store, ObjectStore) and store.start(is_checkpoint_name) is None
    try:
        removed: list[str] = []
        remove = store.store.remove
        monkeypatch.setattr(store.store, "remove", lambda key: (removed.append(key), remove(key)))
        folder = _write_folder(store)
        store.flush()
        assert removed == [] and folder in store.checkpoints()
        store.prepare(FOLDER)
        assert removed == [manifest_name(FOLDER)]
        assert store.store.read(manifest_name(FOLDER)) is None and folder not in store.checkpoints()
    finally:
        store.release()


def test_an_async_save_that_cannot_begin_uploads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's preparation of an asynchronous save failed (the store refused to drop an old
    commit, say): DCP's planning refuses the save, so no object is uploaded, the wait raises
    the cause, and the next save commits."""
    store = _open_store("object store", tmp_path)
    assert isinstance(store, ObjectStore) and store.start(is_checkpoint_name) is None
    try:

        def refused(name: str) -> None:
            raise CheckpointError(f"the store kept the old commit of {name}")

        monkeypatch.setattr(store, "prepare", refused)
        writer = ShardedWriter(NullCommunicator(), lambda: None)
        route = SaveRoute(NullCommunicator(), store)
        contents = ({"format": "x"}, {"model": {"w": WEIGHTS}})
        route.save(store.dir / FOLDER, writer, contents, background=True)
        said = "failed on rank(s) [0]: rank 0: CheckpointError: the store kept the old commit of"
        with pytest.raises(CheckpointError, match=re.escape(said)):
            route.wait()
        assert [key for key in store.store.listing() if key.startswith("ckpt")] == []
        monkeypatch.undo()
        route.save(store.dir / FOLDER, writer, contents, background=True)
        assert route.wait() == store.dir / FOLDER
        store.flush()
        assert store.dir / FOLDER in store.checkpoints()
    finally:
        store.release()


def test_a_folders_listing_reads_only_what_it_is_asked_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotation and naming ask a folder which run wrote its checkpoints at every save: a
    listing reads no checkpoint, the run of one this process committed is known without a
    read, and another process (a rank that did not commit) reads each version once."""
    from nn_handler.checkpoint.store import local

    store = _open_store("local", tmp_path)
    assert store.start(is_checkpoint_name) is None
    file = _write_file(store)
    reads: list[Any] = []
    load = local.load_file
    monkeypatch.setattr(local, "load_file", lambda *a, **k: (reads.append(a), load(*a, **k))[1])
    listing = store.checkpoints()
    assert list(listing) == [file] and reads == []
    assert listing[file] == "run-1" and reads == []  # committed here: known, not read back
    other = _open_store("local", tmp_path)  # another rank's process
    assert other.checkpoints()[file] == "run-1" and len(reads) == 1
    assert other.checkpoints()[file] == "run-1" and len(reads) == 1  # once per version
    store.release()


def test_a_pointer_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    """latest.json is the store's: a failed write says which file, as a CheckpointError."""
    store = _open_store("local", tmp_path)
    assert store.start(is_checkpoint_name) is None
    (store.dir / "latest.json").mkdir()  # a folder where the pointer goes: the rename fails
    try:
        with pytest.raises(CheckpointError, match=r"cannot write .*run/latest\.json"):
            store.write_latest({"checkpoint": FILE, "global_step": 5})
    finally:
        store.release()


def test_a_writer_that_raises_is_a_checkpoint_error_not_a_hang(tmp_path: Path) -> None:
    """Whatever a writer raises, the route still reaches its agreement (every other rank waits
    there) and raises a CheckpointError naming the checkpoint; nothing is committed."""
    store = _open_store("local", tmp_path)
    assert store.start(is_checkpoint_name) is None

    class Broken:
        folder = False

        def begin(self, *args: Any) -> Any:
            def write() -> Any:
                raise RuntimeError("the writer broke")

            return write

    target = store.dir / FILE
    try:
        with pytest.raises(
            CheckpointError, match=rf"writing checkpoint .*{FILE}.*the writer broke"
        ):
            SaveRoute(NullCommunicator(), store).save(target, Broken(), None)  # type: ignore[arg-type]
        assert target not in store.checkpoints()
    finally:
        store.release()
