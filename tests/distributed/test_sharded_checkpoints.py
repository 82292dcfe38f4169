"""Sharded checkpoints (torch.distributed.checkpoint folders) with real gloo groups: every rank
writes its shards; an asynchronous save trains the same; a run resumes exactly from one;
and they reshard: 2 ranks -> 1 and -> 3, 1 -> 2, DDP -> FSDP2, and a consolidated single
file. One 2-rank group runs the 2-rank checks; one 3-rank group resumes at 3; a torchrun
job is SIGKILLed during a save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import HandlerConfig, Hook, NNHandler, Trainer, TrainingPreempted
from nn_handler.checkpoint.consolidate import consolidate
from nn_handler.checkpoint.format import is_sharded
from nn_handler.checkpoint.store.lease import LOCK
from tests.harness import run_commands, run_group, torchrun_command
from tests.resume_helpers import SigtermAt
from tests.training_helpers import max_difference, mlp, read_rest, regression_data, state_of

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parents[2]

DATA = regression_data()
VAL = regression_data(n=14, seed=1)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _config(world: int, folder: Path | None, strategy: str = "fsdp", **ckpt: Any) -> Any:
    trainer: dict[str, Any] = {"accumulate_grad_batches": 2, "progress_bar": False}
    if strategy == "fsdp":
        trainer.update(strategy="fsdp", fsdp={"blocks": ["Linear"]})
    checkpoint = {"dir": None if folder is None else str(folder), "keep_last": 5, **ckpt}
    return HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8 // world, "shuffle": True, "seed": 3},
            "trainer": trainer,
            "ema": {"enabled": True, "decay": 0.9},
            "checkpoint": {"resume": "never", **checkpoint},
        }
    )


def _whole(handler: NNHandler) -> dict[str, torch.Tensor]:
    """The model's whole state on every rank (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        handler.trainer.module, options=StateDictOptions(full_state_dict=True)
    )
    return {k: v.detach().clone() for k, v in state.items()}


def _adam_steps(handler: NNHandler) -> set[int]:
    state = handler.trainer.optimizer.state_dict()["state"]
    return {int(s["step"]) for s in state.values()}


class SeesPending(Hook):
    """Records which folder is still being written in the background as each epoch starts."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str | None] = []

    def before_epoch(self) -> None:
        pending = self.trainer.checkpointing.manager.route.pending
        self.seen.append(None if pending is None else pending.name)


# The exactly-once ledger: 37 samples that carry their index; 2 of an epoch's batches of 4 (8
# for one process) are trained, a mid-epoch checkpoint is written, and another number of ranks
# finishes the epoch.
LEDGER_N = 37


def _indexed() -> Any:
    x, y = regression_data(n=LEDGER_N).tensors
    return TensorDataset(x, y, torch.arange(LEDGER_N))


class LedgerTrainer(Trainer):
    """Records the dataset indices each training step of the first epoch sees."""

    def training_step(self, batch: Any) -> Any:
        inputs, targets, index = batch
        if self.state.epoch == 0:
            self.__dict__.setdefault("ledger", []).extend(index.tolist())
        return self.compute_loss(self.forward(inputs), targets)


def _ledger_run(
    world: int, folder: Path, strategy: str, resume: str | None = None
) -> dict[str, Any]:
    """Two steps of the first epoch (a mid-epoch checkpoint in ``folder``), or, with
    ``resume``, the rest of that epoch from it; this rank's ledger."""
    config = _config(world, folder, strategy=strategy, every_n_epochs=None, every_n_steps=2)
    config = config.model_copy(
        update={
            "trainer": config.trainer.model_copy(
                update={"accumulate_grad_batches": 1, "max_steps": None if resume else 2}
            )
        }
    )
    with NNHandler(
        mlp(), _adam, nn.CrossEntropyLoss(), config=config, trainer_class=LedgerTrainer
    ) as h:
        if resume is not None:
            h.trainer.resume(resume, allow_world_size_change=True)
        h.train(_indexed(), epochs=1)
        return {"ledger": h.trainer.__dict__.get("ledger", []), "epoch": h.trainer.state.epoch}


def _two_ranks(rank: int, world: int, base: str, one_process: str) -> dict[str, Any]:
    folder = Path(base)
    out: dict[str, Any] = {
        "ledger_ddp": _ledger_run(2, folder / "ledger-ddp", "ddp"),
        "ledger_fsdp": _ledger_run(2, folder / "ledger-fsdp", "fsdp"),
        "ledger_from_one": _ledger_run(
            2, folder / "ledger-1to2", "ddp", resume=str(folder / "ledger-one" / (MID + ".pt"))
        ),
    }
    # Three epochs, a sharded checkpoint after each (format 'auto' under FSDP2).
    with NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=_config(2, folder / "sync")) as h:
        h.train(DATA, VAL, epochs=3)
        out["straight"] = _whole(h)
        out["ema"] = h.trainer.ema.state_dict()["module"]  # type: ignore[union-attr]
        out["losses"] = [r["val_loss"] for r in h.history.records]
    out["files"] = sorted(p.name for p in (folder / "sync" / "ckpt-e0003-s00000009").iterdir())
    # The same run saving in the background: the same weights, every checkpoint complete,
    # and resuming one of them ends where the uninterrupted run did.
    config = _config(2, folder / "async", async_save=True)
    sees = SeesPending()
    with NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=config, hooks=[sees]) as h:
        h.train(DATA, VAL, epochs=3)
        out["pending_at_epoch_start"] = sees.seen
        out["async"] = _whole(h)
        out["async_pending"] = h.trainer.checkpointing.manager.route.pending  # type: ignore[union-attr]
    out["async_names"] = sorted(p.name for p in (folder / "async").iterdir())
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=_config(2, None)) as h:
        h.trainer.resume(folder / "async" / "ckpt-e0001-s00000003")
        h.train(DATA, VAL, epochs=3)
        out["async_resumed"] = _whole(h)
    # A SIGTERM on rank 1 after step 4 (inside the second epoch), with saves in the
    # background: every rank stops with a sharded emergency checkpoint, and the relaunch
    # ends where the uninterrupted run did.
    config = _config(2, folder / "preempted", async_save=True)
    try:
        with NNHandler(
            mlp(), _adam, nn.CrossEntropyLoss(), config=config, hooks=[SigtermAt(4, rank=1)]
        ) as h:
            h.train(DATA, VAL, epochs=3)
    except TrainingPreempted as stop:
        saved = Path(stop.checkpoint) if stop.checkpoint else None
        out["preempted"] = (stop.code, stop.global_step, saved and is_sharded(saved))
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=config) as h:
        h.trainer.resume("latest")
        h.train(DATA, VAL, epochs=3)
        out["after_preemption"] = _whole(h)
    # An exact resume from the first epoch's folder.
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=_config(2, None)) as h:
        h.trainer.resume(folder / "sync" / "ckpt-e0001-s00000003")
        h.train(DATA, VAL, epochs=3)
        out["resumed"] = _whole(h)
        out["resumed_losses"] = [r["val_loss"] for r in h.history.records]
    # DDP writing a sharded folder, FSDP2 resuming it, and the other way round.
    ddp = _config(2, None, strategy="ddp", format="sharded")
    with NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=ddp) as h:
        h.train(DATA, epochs=1)
        h.trainer.save_checkpoint(folder / "ddp")
        h.train(DATA, epochs=2)
        out["ddp_straight"] = state_of(h.model)
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=_config(2, None)) as h:
        h.trainer.resume(folder / "ddp")
        h.train(DATA, epochs=2)
        out["ddp_to_fsdp"] = _whole(h)
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=ddp) as h:
        h.trainer.resume(folder / "sync" / "ckpt-e0001-s00000003")
        out["fsdp_to_ddp_steps"] = _adam_steps(h)
        out["fsdp_to_ddp_start"] = state_of(h.model)
    # A folder written by one process, resumed by two.
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=_config(2, None)) as h:
        h.trainer.resume(one_process, allow_world_size_change=True)
        out["from_one"] = _whole(h)
        out["from_one_epoch"] = h.trainer.state.epoch
        h.train(DATA, epochs=2)
        out["from_one_trained"] = h.trainer.state.epoch
    out["copy_failure"] = _a_copy_that_fails_on_rank_1(rank, folder / "copy-failure")
    return out


class _Recording:
    """A communicator that records every method called through it (its collectives)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.calls = comm, []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.comm, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return found(*args, **kwargs)

        return call


def _a_copy_that_fails_on_rank_1(rank: int, folder: Path) -> dict[str, Any]:
    """Asynchronous saves into a local folder on the checkpoint's own group: each returns
    without a collective of the loop's communicator; rank 1's copy of its state fails in the
    first, which both ranks' wait raises alike, committing nothing; the next one commits."""
    import torch.distributed as dist

    from nn_handler.checkpoint.saving import SaveRoute
    from nn_handler.checkpoint.sharded import ShardedWriter
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.distributed.communicator import TorchCommunicator

    group = dist.new_group(backend="gloo")
    comm = _Recording(TorchCommunicator())
    writer = ShardedWriter(comm, lambda: group)  # type: ignore[arg-type]
    route = SaveRoute(comm, LocalStore(folder))  # type: ignore[arg-type]
    shards = {"model": {"w": torch.full((4,), float(rank))}}
    rest = {"format": "x"} if rank == 0 else None
    stage = writer._stager.stage
    if rank == 1:
        writer._stager.stage = _no_memory_left  # type: ignore[method-assign]
    failed, committed = folder / "ckpt-e0001-s00000001", folder / "ckpt-e0002-s00000002"
    route.save(failed, writer, (rest, shards), background=True)
    out: dict[str, Any] = {"calls_in_save": list(comm.calls)}
    writer._stager.stage = stage  # type: ignore[method-assign]
    comm.calls.clear()
    try:
        route.wait()
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    out["calls_in_wait"] = list(comm.calls)
    out["failed_committed"] = failed.exists()
    comm.calls.clear()
    route.save(committed, writer, (rest, shards), background=True)
    out["calls_in_next_save"] = list(comm.calls)
    out["next"] = route.wait() == committed and is_sharded(committed)
    route.close()
    return out


def _no_memory_left(state: Any) -> Any:
    raise RuntimeError("no shared memory left")


def _three_ranks(rank: int, world: int, folder: str, ledger: str) -> dict[str, Any]:
    rest = _ledger_run(3, Path(ledger) / "after", "fsdp", resume=str(Path(ledger) / MID))
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=_config(3, None)) as h:
        h.trainer.resume(folder, allow_world_size_change=True)
        out = {"loaded": _whole(h), "epoch": h.trainer.state.epoch}
        out["local"] = sum(p.to_local().numel() for p in h.trainer.module.parameters())
        h.train(DATA, epochs=4)
        out["trained_to"] = h.trainer.state.epoch
    out["ledger"] = rest
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("sharded")
    single = _config(1, None, strategy="auto", format="sharded")
    with NNHandler(mlp(), _adam, nn.CrossEntropyLoss(), config=single) as h:
        h.train(DATA, epochs=1)
        h.trainer.save_checkpoint(base / "one")
        one = state_of(h.model)
    one_ledger = _ledger_run(1, base / "ledger-one", "auto")
    # Not daemonic: the async run's ranks start writer processes of their own.
    ranks = run_group(_two_ranks, 2, args=(str(base), str(base / "one")), timeout=240, daemon=False)
    return {"base": base, "ranks": ranks, "one": one, "one_ledger": one_ledger}


def test_every_rank_writes_its_shards_into_one_committed_folder(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert seen["files"] == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "manifest.json",
            "trainer.pt",
        ]
    rest = read_rest(runs["base"] / "sync" / "ckpt-e0003-s00000009")
    assert rest["world_size"] == 2 and len(rest["ranks"]) == 2
    assert rest["sharded"] == ["model", "optimizer", "ema"]


def test_an_async_save_blocks_for_no_collective_and_a_failed_copy_fails_every_rank(
    runs: dict[str, Any],
) -> None:
    for seen in runs["ranks"]:
        found = seen["copy_failure"]
        assert found["calls_in_save"] == [] and found["calls_in_next_save"] == []
        # The wait: one gather of every rank's outcome to rank 0, one agreement on the commit.
        collectives = [c for c in found["calls_in_wait"] if c not in ("patient",)]
        assert collectives == ["gather_object", "raise_if_any_failed"], found["calls_in_wait"]
        error = found["error"]
        assert error.startswith("CheckpointError: writing checkpoint"), found
        said = "(in the background) failed: rank 1: copying this rank's state: RuntimeError: no"
        assert said in error, error
        assert error.count("no shared memory left") == 1, error  # said once, by its rank
        assert not found["failed_committed"] and found["next"]


def test_a_sharded_resume_is_bit_identical(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert max_difference(seen["resumed"], seen["straight"]) == 0.0
        assert seen["resumed_losses"] == seen["losses"]


def test_a_preempted_fsdp_run_saves_its_shards_and_resumes_exactly(
    runs: dict[str, Any],
) -> None:
    for seen in runs["ranks"]:
        code, step, sharded = seen["preempted"]
        assert code == 75 and sharded is True and 4 <= step < 9  # stopped inside the run
        assert max_difference(seen["after_preemption"], seen["straight"]) == 0.0


def test_an_asynchronous_save_trains_the_same_and_resumes_exactly(
    runs: dict[str, Any],
) -> None:
    for seen in runs["ranks"]:
        assert max_difference(seen["async"], seen["straight"]) == 0.0
        assert max_difference(seen["async_resumed"], seen["straight"]) == 0.0
        assert seen["async_pending"] is None
        # Each save was still in flight when the next epoch started (it waits at the next).
        assert seen["pending_at_epoch_start"] == [
            None,
            "ckpt-e0001-s00000003",
            "ckpt-e0002-s00000006",
        ]
        assert seen["async_names"] == [
            "ckpt-e0001-s00000003",
            "ckpt-e0002-s00000006",
            "ckpt-e0003-s00000009",
            "latest.json",
        ]


def test_sharded_folders_move_between_ddp_and_fsdp(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert max_difference(seen["ddp_to_fsdp"], seen["ddp_straight"]) < 1e-6
        assert seen["fsdp_to_ddp_steps"] == {3}  # Adam's state came along, resharded
    # The FSDP folder of epoch 1 loads into DDP as the weights FSDP had then.
    ranks = runs["ranks"]
    assert max_difference(ranks[0]["fsdp_to_ddp_start"], ranks[1]["fsdp_to_ddp_start"]) == 0.0


def test_a_one_process_folder_resumes_on_two_ranks(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert max_difference(seen["from_one"], runs["one"]) == 0.0
        assert seen["from_one_epoch"] == 1 and seen["from_one_trained"] == 2


def test_a_two_rank_folder_resumes_in_one_process_and_consolidates(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    source = runs["base"] / "sync" / "ckpt-e0003-s00000009"
    straight, ema = runs["ranks"][0]["straight"], runs["ranks"][0]["ema"]
    single = _config(1, None, strategy="auto")
    with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=single) as h:
        h.trainer.resume(source, allow_world_size_change=True)
        assert max_difference(state_of(h.model), straight) == 0.0
        assert _adam_steps(h) == {9}
    out = consolidate(source, tmp_path / "model.pt")
    with NNHandler.load(out, mlp(seed=5)) as h:  # the stored config said fsdp: now 'auto'
        assert max_difference(state_of(h.model), straight) == 0.0
        assert max_difference(h.trainer.ema.state_dict()["module"], ema) == 0.0  # type: ignore[union-attr]


def test_a_two_rank_folder_resumes_on_three_ranks(runs: dict[str, Any]) -> None:
    folder = runs["base"] / "sync" / "ckpt-e0003-s00000009"
    straight = runs["ranks"][0]["straight"]
    ledger = runs["base"] / "ledger-fsdp"
    ranks = run_group(_three_ranks, 3, args=(str(folder), str(ledger)), timeout=120)
    total = sum(p.numel() for p in mlp().parameters())
    for seen in ranks:
        assert max_difference(seen["loaded"], straight) == 0.0
        assert seen["epoch"] == 3 and seen["trained_to"] == 4
        assert seen["local"] < total / 2  # a third of each block, padded
    # The mid-epoch FSDP folder of 2 ranks: 3 ranks visit the rest of its epoch, each once.
    before = [i for seen in runs["ranks"] for i in seen["ledger_fsdp"]["ledger"]]
    _exactly_once(before, [i for seen in ranks for i in seen["ledger"]["ledger"]])
    assert {seen["ledger"]["epoch"] for seen in ranks} == {1}


MID = "ckpt-e0000-s00000002"


def _exactly_once(before: list[int], after: list[int]) -> None:
    """The interrupted epoch's samples: 2 steps before the checkpoint, the rest after it,
    every sample of the dataset exactly once."""
    assert len(before) == 16 and len(set(before)) == 16  # 2 steps of 8 samples in all
    assert sorted(before + after) == list(range(LEDGER_N)), (sorted(before), sorted(after))


def test_a_mid_epoch_position_continues_on_another_number_of_ranks_exactly_once(
    runs: dict[str, Any],
) -> None:
    """2 ranks -> 1 (DDP, one file) and 1 -> 2 (sharded folder of one process, DDP); 2 -> 3
    (FSDP2, sharded) is checked with the 3-rank group above."""
    ranks = runs["ranks"]
    assert [p.name for p in (runs["base"] / "ledger-ddp").glob("ckpt-*")] == [MID + ".pt"]
    before = [i for seen in ranks for i in seen["ledger_ddp"]["ledger"]]
    rest = _ledger_run(
        1, runs["base"] / "ledger-2to1", "auto", str(runs["base"] / "ledger-ddp" / (MID + ".pt"))
    )
    _exactly_once(before, rest["ledger"])
    assert rest["epoch"] == 1
    after = [i for seen in ranks for i in seen["ledger_from_one"]["ledger"]]
    _exactly_once(runs["one_ledger"]["ledger"], after)
    assert {seen["ledger_from_one"]["epoch"] for seen in ranks} == {1}


KILLS = ["before_shards", "before_commit"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """Both kill points, as two torchrun jobs side by side."""
    base = tmp_path_factory.mktemp("killed")
    script = ROOT / "tests" / "scripts" / "torchrun_sharded_kill.py"
    folders = {when: base / when for when in KILLS}
    commands = [torchrun_command(script, str(folders[when]), when) for when in KILLS]
    results = run_commands(commands, timeout=180)
    return {when: (folders[when], *result) for when, result in zip(KILLS, results, strict=True)}


@pytest.mark.parametrize("when", KILLS)
def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint(
    killed: dict[str, tuple[Path, int, str]], when: str
) -> None:
    """A rank is SIGKILLed inside the second epoch's save (rank 1 before writing its shards,
    or rank 0 once every shard and the index are written, just before the rename): the first
    epoch's folder stays the latest, the staging folder is removed at the next start, and the
    run resumes from it."""
    folder, code, output = killed[when]
    assert code != 0, output
    names = sorted(p.name for p in folder.iterdir())
    assert "ckpt-e0001-s00000003" in names and "ckpt-e0002-s00000006" not in names, names
    assert any(n.startswith(".ckpt-e0002-s00000006") for n in names), names  # the staging
    assert '"checkpoint": "ckpt-e0001-s00000003"' in (folder / "latest.json").read_text()
    with NNHandler(
        mlp(seed=5),
        _adam,
        nn.CrossEntropyLoss(),
        # The torchrun script's run has its own settings (lr, no EMA): continuing it from
        # this test's configuration is the user's explicit choice.
        config=_config(1, folder, strategy="auto", allow_world_size_change=True, resume="force"),
    ) as h:
        hidden = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
        assert hidden == [LOCK], hidden  # the staging folder cleaned; the folder is this job's
        assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()  # taken over
        found = h.trainer.resume("latest")
        assert found is not None and found.name == "ckpt-e0001-s00000003"
        assert is_sharded(found) and h.trainer.state.epoch == 1


def _a_store_that_fails_to_start_on_rank_0(rank: int, world: int, base: str) -> str:
    """Rank 0's store cannot start with an error of any kind: every rank raises the same
    CheckpointError from the manager's agreement (none waits in it)."""
    import contextlib as _contextlib
    from collections.abc import Iterator

    from nn_handler.checkpoint import manager as manager_module
    from nn_handler.checkpoint.manager import CheckpointManager
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.config import CheckpointConfig
    from nn_handler.distributed.communicator import TorchCommunicator
    from nn_handler.errors import CheckpointError

    class Broken(LocalStore):
        @_contextlib.contextmanager
        def session(self, lead: bool) -> Iterator[None]:
            if lead:
                raise RuntimeError("the folder's disk went away")
            yield

    manager_module.open_store = lambda config: Broken(Path(str(config.dir)))  # type: ignore[assignment]
    try:
        CheckpointManager(CheckpointConfig(dir=base), TorchCommunicator())
    except CheckpointError as error:
        return str(error)
    return "no error"


def test_a_store_that_cannot_start_on_rank_0_fails_every_rank(tmp_path: Path) -> None:
    said = run_group(_a_store_that_fails_to_start_on_rank_0, 2, args=(str(tmp_path),), timeout=60)
    for text in said:
        assert "starting checkpoints in" in text and "the folder's disk went away" in text, said
