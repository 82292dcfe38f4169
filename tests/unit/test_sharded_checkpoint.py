"""Sharded checkpoints (checkpoint/sharded.py) in one process: the folder's layout, an exact
resume, asynchronous saves, best/, orphaned staging folders, consolidate and inspect, and
their error paths. The multi-rank cases (resharding, DDP <-> FSDP2, a kill during a save)
are in tests/distributed/test_sharded_checkpoints.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import CheckpointError, ConfigError, HandlerConfig, NNHandler
from nn_handler.checkpoint.consolidate import consolidate
from nn_handler.checkpoint.format import REST, is_sharded
from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.store import LATEST
from nn_handler.checkpoint.store.files import staging_path
from nn_handler.cli import main
from tests.training_helpers import max_difference, mlp, read_rest, regression_data, state_of

DATA = regression_data()
VAL = regression_data(n=16, seed=1)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _handler(folder: Path, seed: int = 0, **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "shuffle": True, "seed": 3},
            "trainer": {"progress_bar": False},
            "ema": {"enabled": True, "decay": 0.9},
            "checkpoint": {
                "dir": str(folder),
                "format": "sharded",
                "keep_last": 5,
                "resume": "never",
                **checkpoint,
            },
        }
    )
    return NNHandler(mlp(seed=seed), _adam, nn.CrossEntropyLoss(), config=config)


def _ema_weights(handler: NNHandler) -> dict[str, torch.Tensor]:
    ema = handler.trainer.ema
    assert ema is not None
    return {k: v.clone() for k, v in ema.state_dict()["module"].items()}


def _losses(records: list[dict[str, float]]) -> list[tuple[float, float]]:
    return [(r["train_loss"], r["val_loss"]) for r in records]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three epochs with a sharded checkpoint after each, and what they left."""
    folder = tmp_path_factory.mktemp("sharded")
    with _handler(folder) as h:
        h.train(DATA, VAL, epochs=3)
        return {
            "folder": folder,
            "model": state_of(h.model),
            "ema": _ema_weights(h),
            "history": h.history.records,
            "optimizer_steps": h.trainer.state.global_step,
        }


def test_a_sharded_checkpoint_is_a_committed_folder(straight: dict[str, Any]) -> None:
    folder: Path = straight["folder"]
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "ckpt-e0001-s00000005",
        "ckpt-e0002-s00000010",
        "ckpt-e0003-s00000015",
        LATEST,
    ]
    newest = folder / "ckpt-e0003-s00000015"
    assert is_sharded(newest)
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "manifest.json",
        REST,
    ]
    assert json.loads((folder / LATEST).read_text())["checkpoint"] == newest.name
    rest = read_rest(newest)
    assert rest["sharded"] == ["model", "optimizer", "ema"]
    assert "model" not in rest and "optimizer" not in rest  # they are in the shards
    assert rest["trainer"]["epoch"] == 3 and len(rest["ranks"]) == 1


def test_resuming_a_sharded_checkpoint_is_bit_identical(
    straight: dict[str, Any], tmp_path: Path
) -> None:
    first = straight["folder"] / "ckpt-e0001-s00000005"
    with _handler(tmp_path, seed=5) as h:
        assert h.trainer.resume(first) == first
        assert h.trainer.state.epoch == 1
        h.train(DATA, VAL, epochs=3)
        assert max_difference(state_of(h.model), straight["model"]) == 0.0
        assert max_difference(_ema_weights(h), straight["ema"]) == 0.0
        assert _losses(h.history.records) == _losses(straight["history"])


def test_an_asynchronous_save_is_complete_when_fit_returns(
    straight: dict[str, Any], tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """... and says nothing of torch's: DCP's "torch.distributed is disabled" notice came at
    every one-process save made in the background (issue 69, item 10)."""
    with _handler(tmp_path, async_save=True) as h:
        h.train(DATA, VAL, epochs=3)
        notices = [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
        assert not notices, [str(w.message) for w in notices]
        assert h.trainer.checkpointing.manager is not None
        assert h.trainer.checkpointing.manager.route.pending is None
        assert max_difference(state_of(h.model), straight["model"]) == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in straight["folder"].iterdir()
    )
    with _handler(tmp_path, seed=5) as h:  # the latest resumes: the run is complete
        h.trainer.resume("latest")
        assert h.trainer.state.global_step == straight["optimizer_steps"]
        assert max_difference(state_of(h.model), straight["model"]) == 0.0


def test_the_removed_writer_process_is_said_once_and_the_thread_saves(
    straight: dict[str, Any], tmp_path: Path
) -> None:
    """``async_writer: process`` (removed: no measured gain) still loads from an earlier
    configuration: one warning naming the setting, and the background saves in the thread
    end with the same weights."""
    from loguru import logger

    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        with _handler(tmp_path, async_save=True, async_writer="process") as h:
            h.train(DATA, VAL, epochs=3)
            assert max_difference(state_of(h.model), straight["model"]) == 0.0
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    removed = [m for m in seen if "async_writer='process' was removed" in m]
    assert len(removed) == 1, seen
    assert "drop the setting" in removed[0]


def test_a_save_due_while_the_previous_is_still_writing_waits_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str]
) -> None:
    """A background save slower than the steps between saves: the next save waits for it
    (one in flight at most), and each wait is measured and said once; the run still ends
    where the synchronous one does."""
    from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter

    write_data = ChecksummingWriter.write_data

    def slow(self: ChecksummingWriter, plan: Any, planner: Any) -> Any:
        time.sleep(1.5)  # the disk is slower than two steps
        return write_data(self, plan, planner)

    with _handler(tmp_path / "synchronous", every_n_steps=2) as h:
        h.train(DATA, VAL, epochs=1)
        synchronous = state_of(h.model)
    monkeypatch.setattr(ChecksummingWriter, "write_data", slow)
    with _handler(tmp_path / "background", async_save=True, every_n_steps=2) as h:
        h.train(DATA, VAL, epochs=1)
        assert max_difference(state_of(h.model), synchronous) == 0.0
    waits = [line for line in lines if "waited" in line and "for the previous one" in line]
    # Saves at steps 2 and 4 and at the epoch's end (5): the last two wait for the one before.
    assert [w.split(":")[0] for w in waits] == ["checkpoint at step 4", "checkpoint at step 5"]
    for wait in waits:
        seconds = float(wait.split("waited ")[1].split(" s")[0])
        assert 0.5 <= seconds < 1.5 * 40, wait
        assert "still being written in the background" in wait


def test_best_is_a_folder_of_links_to_the_best_checkpoint(tmp_path: Path) -> None:
    with _handler(tmp_path, save_best=True, save_top_k=2, monitor="val_loss", keep_last=3) as h:
        h.train(DATA, VAL, epochs=3)
        losses = [r["val_loss"] for r in h.history.records]
    best = tmp_path / "best"
    assert is_sharded(best)
    epoch = 1 + losses.index(min(losses))
    assert read_rest(best)["trainer"]["epoch"] == epoch
    source = next(tmp_path.glob(f"ckpt-e{epoch:04d}-*"))
    assert (best / "__0_0.distcp").stat().st_ino == (source / "__0_0.distcp").stat().st_ino
    # save_top_k: the two best epochs as folders of links, the third deleted.
    kept = sorted(sorted(range(3), key=lambda i: losses[i])[:2])
    tops = sorted(tmp_path.glob("top-*"))
    assert [int(p.name[5:9]) for p in tops] == [i + 1 for i in kept], tops
    for top in tops:
        assert is_sharded(top) and read_rest(top)["trainer"]["epoch"] == int(top.name[5:9])


def test_a_staging_folder_left_by_a_killed_save_is_removed(tmp_path: Path) -> None:
    staging = staging_path(tmp_path / "ckpt-e0004-s00000020")
    staging.mkdir()
    (staging / REST).write_bytes(b"half")
    with _handler(tmp_path) as h:
        assert not staging.exists()
        assert h.trainer.resume("latest", missing_ok=True) is None


def test_consolidate_writes_one_file_that_nn_handler_load_restores(
    straight: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = straight["folder"] / "ckpt-e0003-s00000015"
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", str(source), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    saved = load_file(out)
    assert "optimizer" not in saved and saved["consolidated_without"] == ["optimizer"]
    assert saved["config"]["handler"]["checkpoint"]["format"] == "auto"
    with NNHandler.load(out, mlp(seed=5)) as h:
        assert max_difference(state_of(h.model), straight["model"]) == 0.0
        assert max_difference(_ema_weights(h), straight["ema"]) == 0.0
        assert h.trainer.state.epoch == 3
    # NNHandler.load takes the folder itself too (same strategy, here one process).
    with NNHandler.load(source, mlp(seed=5), _adam) as h:
        assert max_difference(state_of(h.model), straight["model"]) == 0.0
        steps = {int(s["step"]) for s in h.trainer.optimizer.state_dict()["state"].values()}
        assert steps == {15}


def test_inspect_describes_a_sharded_folder_without_reading_its_shards(
    straight: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    source = straight["folder"] / "ckpt-e0003-s00000015"
    assert main(["checkpoint", "inspect", str(source)]) == 0
    text = capsys.readouterr().out
    assert "(sharded: 1 shard file(s)" in text
    assert "epochs done 3, optimizer steps 15" in text
    params = sum(p.numel() for p in mlp().parameters())
    assert f"  model: 4 tensor(s), {params * 4} B" in text
    assert "  optimizer: 12 tensor(s)" in text  # exp_avg, exp_avg_sq, step per parameter
    assert "  ema: 4 tensor(s)" in text


def test_sharded_error_paths(straight: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a sharded checkpoint folder"):
        consolidate(tmp_path, tmp_path / "out.pt")
    assert main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o.pt")]) == 1
    with pytest.raises(ConfigError, match="async_save writes sharded checkpoints"):
        HandlerConfig.from_dict({"checkpoint": {"format": "file", "async_save": True}})
    auto = {"checkpoint": {"dir": str(tmp_path), "async_save": True}, "trainer": {}}
    with pytest.raises(ConfigError, match="format='auto' shards with strategy='fsdp' only"):
        NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=auto)
    rest = read_rest(straight["folder"] / "ckpt-e0001-s00000005")
    with _handler(tmp_path / "other") as h:
        with pytest.raises(CheckpointError, match="unsharded parts of a sharded checkpoint"):
            h.trainer.load_state_dict(rest)
        wrong = NNHandler(nn.Linear(6, 3), _adam, nn.CrossEntropyLoss())
        missing = r"cannot load the shards of .*: rank 0: RuntimeError: Missing key in checkpoint"
        with wrong, pytest.raises(CheckpointError, match=missing):
            wrong.trainer.resume(straight["folder"] / "ckpt-e0001-s00000005")


def test_the_async_stager_copies_into_the_same_buffers_until_the_layout_changes() -> None:
    from nn_handler.checkpoint.sharded import CachedStager

    stager = CachedStager()
    state = {"model": {"w": torch.zeros(3, 2)}, "optimizer": {"step": 1, "m": [torch.ones(4)]}}
    first = stager.stage(state)
    state["model"]["w"] += 5  # training changes the state after the copy
    assert torch.equal(first["model"]["w"], torch.zeros(3, 2))
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # reused
    assert torch.equal(second["model"]["w"], torch.full((3, 2), 5.0))
    assert second["optimizer"]["step"] == 1 and torch.equal(
        second["optimizer"]["m"][0], torch.ones(4)
    )
    state["model"]["w"] = torch.zeros(5)  # another layout: new buffers
    third = stager.stage(state)
    assert third["model"]["w"].shape == (5,)
    assert third["model"]["w"].data_ptr() != first["model"]["w"].data_ptr()


def test_an_asynchronous_save_that_fails_before_writing_is_told_when_waited_for(
    tmp_path: Path,
) -> None:
    """An asynchronous save returns once the state is copied, with no collective before it
    does: a failure before the background write (rank 0's preparation, this rank's copy) is
    raised by the wait, as a failed write is, and nothing is committed; the next save works."""
    from nn_handler.checkpoint.saving import SaveRoute
    from nn_handler.checkpoint.sharded import ShardedWriter
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.distributed.communicator import NullCommunicator

    writer = ShardedWriter(NullCommunicator(), lambda: None)
    route = SaveRoute(NullCommunicator(), LocalStore(tmp_path))
    shards = {"model": {"w": torch.ones(2)}}
    first = tmp_path / "ckpt-e0001-s00000001"
    assert route.save(first, writer, (None, shards), background=True) == first
    assert route.pending == first
    with pytest.raises(CheckpointError, match=r"no checkpoint contents were given on rank 0"):
        route.wait()
    assert route.pending is None and not first.exists()

    def full(state: Any) -> Any:
        raise RuntimeError("no shared memory left")

    stage, writer._stager.stage = writer._stager.stage, full  # type: ignore[method-assign]
    second = tmp_path / "ckpt-e0002-s00000002"
    route.save(second, writer, ({"format": "x"}, shards), background=True)
    with pytest.raises(
        CheckpointError,
        match=r"\(in the background\).*copying this rank's state: RuntimeError: no shared",
    ):
        route.wait()
    assert not second.exists()
    writer._stager.stage = stage  # type: ignore[method-assign]
    third = tmp_path / "ckpt-e0003-s00000003"
    route.save(third, writer, ({"format": "x"}, shards), background=True)
    assert route.wait() == third and is_sharded(third)


def test_sharded_checkpoints_of_several_ranks_need_a_process_group() -> None:
    from types import SimpleNamespace

    from nn_handler.config.training import TrainerConfig
    from nn_handler.strategies.single import SingleDeviceStrategy

    double = SimpleNamespace(world_size=2, rank=0)  # a test double of two ranks, no group
    strategy = SingleDeviceStrategy(double, torch.device("cpu"), TrainerConfig())  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"use checkpoint\.format='file' with a test communicator"
    ):
        strategy.checkpoint_group()


def test_a_failed_sharded_save_is_a_checkpoint_error_and_leaves_no_folder(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from nn_handler.checkpoint.saving import SaveRoute, _Pending
    from nn_handler.checkpoint.sharded import ShardedWriter
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.distributed.communicator import NullCommunicator

    comm = NullCommunicator()
    writer, shards = ShardedWriter(comm, lambda: None), {"model": {"w": torch.ones(2)}}
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"writing checkpoint .*ckpt"):
        SaveRoute(comm, LocalStore(blocker)).save(blocker / "ckpt", writer, ({"x": 1}, shards))
    store = LocalStore(tmp_path)
    route = SaveRoute(comm, store)
    with pytest.raises(CheckpointError, match="no checkpoint contents were given on rank 0"):
        route.save(tmp_path / "ckpt", writer, (None, shards))
    failed: Future[Any] = Future()
    failed.set_exception(OSError("disk gone"))
    target = tmp_path / "late"
    staging = store.staging(target, folder=True)
    route._pending = _Pending(target, staging, writer, None, None, future=failed)
    with pytest.raises(CheckpointError, match=r"\(in the background\).*OSError: disk gone"):
        route.wait()
    assert route.pending is None and not target.exists()


def test_a_mid_epoch_world_change_needs_the_distributed_loader(tmp_path: Path) -> None:
    """A rank-cached loader's shards are not a prefix of one order: refused, with the way
    out (the sharded parts are put back as a whole model: this run writes files)."""
    with _handler(tmp_path, every_n_steps=2) as h:
        h.train(DATA, epochs=1)
    mid = read_rest(next(tmp_path.glob("ckpt-e0000-*")))
    mid["world_size"] = 2
    config = HandlerConfig.from_dict(
        {"loader": {"batch_size": 8, "mode": "rank_cached"}, "trainer": {"progress_bar": False}}
    )
    with NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=config) as h:
        h.trainer.load_state_dict(
            {k: v for k, v in mid.items() if k != "sharded"} | {"model": state_of(h.model)},
            "mid.pt",
            allow_world_size_change=True,
        )
        with pytest.raises(CheckpointError, match="only with the LoaderFactory's distributed"):
            h.train(DATA, epochs=1)


def test_only_the_distributed_training_loader_can_continue_a_mid_epoch_world_change() -> None:
    from nn_handler.data.reshard import rest_of_epoch

    for loader in ([(torch.ones(2), torch.zeros(2))], torch.utils.data.DataLoader(DATA)):
        with pytest.raises(CheckpointError, match=r"sampler is (NoneType|SequentialSampler)"):
            rest_of_epoch(
                loader, saved_world=2, saved_batch_size=8, batches_done=1, rank=0, world_size=1
            )
