"""The store contract, run against every CheckpointStore (a local folder, an object store on
fsspec's in-memory one, and tests/fake_store.py's fake in 40 lines): a checkpoint written
into the staging place is trusted only once committed; a copy, the pointer and a removal
are seen by every reader; a kill between the puts and the commit leaves nothing trusted and
nothing behind; a changed byte is named when the checkpoint is opened. The stores that write
manifests: one format, and a manifest that cannot be read gets nothing deleted."""

from __future__ import annotations

import contextlib
import re
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nn_handler.checkpoint.manifest import MANIFEST, Manifest, manifest_name, read_manifest
from nn_handler.checkpoint.opening import read
from nn_handler.checkpoint.run_identity import RUN
from nn_handler.checkpoint.saving import SaveRoute
from nn_handler.checkpoint.sharded import ShardedWriter
from nn_handler.checkpoint.store import CheckpointStore, LocalStore
from nn_handler.checkpoint.store.object_store import ObjectStore
from nn_handler.config import CheckpointConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import CheckpointError
from tests import fake_store
from tests.fake_store import FakeStore
from tests.training_helpers import save_folder

FILE, FOLDER = "ckpt-e0001-s00000005.pt", "ckpt-e0002-s00000010"
WEIGHTS = torch.arange(4096, dtype=torch.float32)


def _open_store(kind: str, tmp_path: Path, copy: str = "copy") -> CheckpointStore:
    if kind == "local":
        return LocalStore(tmp_path / "run")
    if kind == "fake":
        return FakeStore(tmp_path / "run")
    url = f"memory://{tmp_path.name}-{uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path)).hex}/run"
    return ObjectStore(CheckpointConfig(dir=url, staging_dir=str(tmp_path / copy)))


def _where(store: CheckpointStore) -> str:
    """The store as its user names it (what opened it knows)."""
    return store.where if isinstance(store, (LocalStore, ObjectStore)) else str(store.dir)


def _read(path: str | Path, store: CheckpointStore) -> Any:
    return read(path, store=store, where=_where(store))


@pytest.fixture(params=["local", "object store", "fake"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["local", "object store"])
def real_kind(request: pytest.FixtureRequest) -> str:
    """The stores that write manifests."""
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path) -> Iterator[CheckpointStore]:
    opened = _open_store(kind, tmp_path)
    with opened.session(lead=True):
        yield opened


@pytest.fixture
def sessions() -> Iterator[contextlib.ExitStack]:
    """Stores' sessions, left at the end of the test."""
    with contextlib.ExitStack() as stack:
        yield stack


@contextlib.contextmanager
def _restarted(kind: str, tmp_path: Path, copy: str) -> Iterator[CheckpointStore]:
    """The store as the next job's rank 0 finds it (a fresh working copy for an object
    store: another machine)."""
    fresh = _open_store(kind, tmp_path, copy)
    with fresh.session(lead=True):
        yield fresh


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


def test_the_fake_store_fits_in_40_lines() -> None:
    source = Path(fake_store.__file__).read_text()
    assert len(source[source.index("class FakeStore") :].splitlines()) <= 40


def test_a_committed_file_and_folder_are_trusted_and_open(
    kind: str, store: CheckpointStore, tmp_path: Path
) -> None:
    file, folder = _write_file(store), _write_folder(store)
    store.flush()
    assert store.checkpoints() == {file: "run-1", folder: "run-1"}  # the run that wrote each
    reader = _open_store(kind, tmp_path, "copy-r")  # another machine, outside a session
    assert [p.name for p in reader.checkpoints()] == [FILE, FOLDER]
    assert torch.equal(_read(file, reader).contents["w"], WEIGHTS)
    opened = _read(folder, reader)
    assert opened.folder is not None and opened.contents["n"] == 1
    if kind == "fake":
        return
    local = read_manifest(folder)  # one format, inside a local folder...
    assert local is not None and local.run == "run-1"
    assert set(local.files()) == {"__0_0.distcp", ".metadata", "trainer.pt"}
    if isinstance(store, ObjectStore):  # ... and beside each checkpoint on the store
        for name in (FILE, FOLDER):
            data = store.store.read(manifest_name(name))
            assert data is not None and Manifest.from_bytes(data, name).name == name
        remote = Manifest.from_bytes(store.store.read(manifest_name(FOLDER)) or b"", FOLDER)
        assert remote.objects == local.objects  # the same manifest in both places
        assert f"{FOLDER}/{MANIFEST}" not in store.store.listing()  # and only one there
        shard = remote.objects[f"{FOLDER}/__0_0.distcp"]
        assert shard["segments"][0][3] == "model.w"  # checked by item as it downloads
        assert opened.where.startswith("memory://") and opened.verified


def test_a_copy_the_pointer_and_a_removal(
    kind: str, store: CheckpointStore, tmp_path: Path
) -> None:
    """A copy of a committed checkpoint is committed under its own name; latest.json names
    a committed checkpoint or none; a removed one is gone for every reader."""
    file, best = _write_file(store), store.dir / "best.pt"
    store.commit(best, FILE, "run-1")
    store.write_latest({"checkpoint": FILE, "global_step": 5})
    store.flush()
    listing = store.checkpoints()
    assert list(listing) == [best, file] and listing.latest == file and listing[best] == "run-1"
    assert torch.equal(_read(best, store).contents["w"], WEIGHTS)
    store.remove(file)
    store.flush()
    assert list(store.checkpoints()) == [best] and store.checkpoints().latest is None
    reader = _open_store(kind, tmp_path, "copy-r")
    assert [p.name for p in reader.checkpoints()] == ["best.pt"]
    assert torch.equal(_read(best, reader).contents["w"], WEIGHTS)


def test_a_kill_between_the_puts_and_the_commit_leaves_nothing_trusted(
    kind: str, store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_file(store, commit=False)  # written, never committed
    monkeypatch.setattr(type(store), "commit", _killed)
    with pytest.raises(CheckpointError, match="killed before the commit"):
        _write_folder(store)  # every rank's files put, then killed
    monkeypatch.undo()
    with _restarted(kind, tmp_path, "copy-2") as fresh:
        assert fresh.checkpoints() == {}
        left = sorted(p.name for p in fresh.dir.iterdir() if p.name.startswith("."))
        assert left == ([] if kind == "fake" else [".nn_handler.lock"])  # no staging left
        if isinstance(fresh, ObjectStore):
            assert [k for k in fresh.store.listing() if k.startswith("ckpt")] == []


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
    else:
        target.write_bytes(bytes(data))
    reader = _open_store(kind, tmp_path, "copy-2")
    with pytest.raises(CheckpointError, match=rf"{FILE}.* is corrupt|corrupt: .*{FILE}"):
        _read(reader.dir / FILE, reader)


def test_an_unreadable_manifest_gets_nothing_deleted(real_kind: str, tmp_path: Path) -> None:
    kind, store = real_kind, _open_store(real_kind, tmp_path)
    with store.session(lead=True):
        folder = _write_folder(store)
    store.flush()
    if isinstance(store, ObjectStore):
        before = set(store.store.listing())
        store.store.write(manifest_name(FOLDER), b'{"format": "nn_handler.manifest", "ver')
    else:
        before = {p.name for p in folder.iterdir()}
        (folder / MANIFEST).write_bytes(b'{"format": "nn_handler.manifest", "ver')
    with _restarted(kind, tmp_path, "copy-2") as fresh:
        if isinstance(fresh, ObjectStore):
            assert before <= set(fresh.store.listing()) and fresh.checkpoints() == {}
        else:
            assert {p.name for p in folder.iterdir()} == before
            with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable"):
                read_manifest(folder)


def test_each_byte_of_a_folder_save_is_checksummed_once(
    real_kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    store = _open_store(real_kind, tmp_path)
    with store.session(lead=True):
        folder = _write_folder(store)
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
    with store.session(lead=True):
        _write_folder(store)
    assert isinstance(store, ObjectStore)
    key = f"{FOLDER}/__0_0.distcp"
    store.store.write(key, damage(store.store.read(key) or b""))
    fresh = _open_store("object store", tmp_path, "copy-2")  # another machine reads it
    with pytest.raises(CheckpointError, match=named):
        _read(FOLDER, fresh)


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sessions: contextlib.ExitStack
) -> None:
    """Before a checkpoint is written under a name the store has committed (a run resumed
    before a checkpoint that its killed predecessor committed), that name's manifest is
    deleted, so that it never vouches for new objects; a name never committed (every
    periodic one) costs no request to the store. Only the lead's staging does it."""
    store = _open_store("object store", tmp_path)
    assert isinstance(store, ObjectStore)
    sessions.enter_context(store.session(lead=True))
    removed: list[str] = []
    remove = store.store.remove
    monkeypatch.setattr(store.store, "remove", lambda key: (removed.append(key), remove(key)))
    folder = _write_folder(store)
    store.flush()
    assert removed == [] and folder in store.checkpoints()
    other = _open_store("object store", tmp_path, "copy-2")  # another rank's
    with other.session(lead=False):
        other.staging(folder, folder=True)
    assert store.store.read(manifest_name(FOLDER)) is not None  # another rank drops nothing
    store.staging(folder, folder=True)
    assert removed == [manifest_name(FOLDER)]
    assert store.store.read(manifest_name(FOLDER)) is None and folder not in store.checkpoints()


def test_an_async_save_that_cannot_begin_uploads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sessions: contextlib.ExitStack
) -> None:
    """Rank 0's preparation of an asynchronous save failed (the store refused to drop an old
    commit, say): DCP's planning refuses the save, so no object is uploaded, the wait raises
    the cause, and the next save commits."""
    store = _open_store("object store", tmp_path)
    assert isinstance(store, ObjectStore)
    sessions.enter_context(store.session(lead=True))

    def refused(target: Path, folder: bool = False) -> Path:
        raise CheckpointError(f"the store kept the old commit of {target.name}")

    monkeypatch.setattr(store, "staging", refused)
    writer = ShardedWriter(NullCommunicator(), lambda: None)
    route = SaveRoute(NullCommunicator(), store, store.where)
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


def test_a_folders_listing_reads_only_what_it_is_asked_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sessions: contextlib.ExitStack
) -> None:
    """Rotation and naming ask a folder which run wrote its checkpoints at every save: a
    listing reads no checkpoint, the run of one this process committed is known without a
    read, and another process (a rank that did not commit) reads each version once."""
    from nn_handler.checkpoint.store import local

    store = _open_store("local", tmp_path)
    sessions.enter_context(store.session(lead=True))
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


def test_a_pointer_that_cannot_be_written_is_named(
    tmp_path: Path, sessions: contextlib.ExitStack
) -> None:
    """latest.json is the store's: a failed write says which file, as a CheckpointError."""
    store = _open_store("local", tmp_path)
    sessions.enter_context(store.session(lead=True))
    (store.dir / "latest.json").mkdir()  # a folder where the pointer goes: the rename fails
    with pytest.raises(CheckpointError, match=r"cannot write .*run/latest\.json"):
        store.write_latest({"checkpoint": FILE, "global_step": 5})


def test_a_writer_that_raises_is_a_checkpoint_error_not_a_hang(
    tmp_path: Path, sessions: contextlib.ExitStack
) -> None:
    """Whatever a writer raises, the route still reaches its agreement (every other rank waits
    there) and raises a CheckpointError naming the checkpoint; nothing is committed."""
    store = _open_store("local", tmp_path)
    sessions.enter_context(store.session(lead=True))

    class Broken:
        folder = False

        def begin(self, *args: Any) -> Any:
            def write() -> Any:
                raise RuntimeError("the writer broke")

            return write

    target = store.dir / FILE
    with pytest.raises(CheckpointError, match=rf"writing checkpoint .*{FILE}.*the writer broke"):
        SaveRoute(NullCommunicator(), store).save(target, Broken(), None)  # type: ignore[arg-type]
    assert target not in store.checkpoints()


def test_a_session_left_late_gives_up_only_its_own_lock(real_kind: str, tmp_path: Path) -> None:
    """Two stores of one folder in one process (a handler built again in a notebook, the first
    never closed): the first one's session, left late (its manager collected), leaves the
    lock the second one holds now."""
    from nn_handler.checkpoint.store.lease import LOCK

    first, second = _open_store(real_kind, tmp_path), _open_store(real_kind, tmp_path, "copy-2")

    def locked() -> bool:
        if isinstance(second, ObjectStore):
            return second.store.read(LOCK) is not None
        return (second.dir / LOCK).exists()

    with contextlib.ExitStack() as old:
        old.enter_context(first.session(lead=True))
        with second.session(lead=True):  # takes the lock over: it is this process's
            old.close()
            assert locked()
    assert not locked()


def test_a_copy_that_fails_is_a_checkpoint_error_on_every_rank(
    tmp_path: Path, sessions: contextlib.ExitStack
) -> None:
    """best/top-k copies go through the route: a copy of a checkpoint that is not there is a
    CheckpointError naming the copy, raised through the agreement (no rank skips it), and
    nothing is committed under the copy's name."""
    store = _open_store("local", tmp_path)
    sessions.enter_context(store.session(lead=True))
    route = SaveRoute(NullCommunicator(), store)
    best = store.dir / "best.pt"
    with pytest.raises(CheckpointError, match=r"writing checkpoint .*best\.pt failed"):
        route.copy(store.dir / FILE, best, "run-1")
    assert best not in store.checkpoints()
    assert route.copy(_write_file(store), best, "run-1") == best
    assert torch.equal(_read(best, store).contents["w"], WEIGHTS)
