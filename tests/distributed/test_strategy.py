"""The Strategy seam and the Trainer's parts in a real 2-rank gloo group: 'auto' is DDP,
'single' is refused, a communicator double that disagrees with the group is a ConfigError
naming both views; the collectives per step, extra logged values, per-rank tracked state, the
after_optimizer_step point, a GAN, and the throughput monitor's verdict on a straggler. One
spawned group runs every check (the suite stays fast); each test reads its part of the
results."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import ConfigError, NNHandler
from nn_handler.strategies import DDPStrategy
from tests.harness import run_group
from tests.training_helpers import mlp, sgd
from tests.unit.test_strategy import FakeWorld

pytestmark = pytest.mark.distributed


def _choices(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as handler:
        seen["auto"] = type(handler.trainer.strategy).__name__
        seen["wrapped"] = type(handler.trainer.model).__name__
        seen["reduces"] = handler.trainer.strategy.reduces_gradients
    for config, communicator in (
        ({"trainer": {"strategy": "single"}}, None),
        ({}, FakeWorld(rank, 3)),
    ):
        try:
            NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, communicator=communicator)
        except ConfigError as error:
            seen.setdefault("errors", []).append(str(error))
    return seen


def _every_check(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    return {
        "choices": _choices(rank, world_size),
        "collectives": _collectives_per_epoch(rank, world_size),
        "extras": _extras_on_two_ranks(rank, world_size),
        "tracked": _tracked_per_rank(rank, world_size, folder),
        "optimizer_steps": _optimizer_step_hooks(rank, world_size),
        "validations": _mid_epoch_validations(rank, world_size),
        "gan": _gan_on_two_ranks(rank, world_size),
        "monitor": _monitor_on_two_ranks(rank, world_size),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("tracked")
    return run_group(_every_check, 2, args=(str(folder),), timeout=240)


def test_strategy_choices_in_a_real_group(results: list[dict[str, Any]]) -> None:
    for rank, seen in enumerate(r["choices"] for r in results):
        assert seen["auto"] == DDPStrategy.__name__ and seen["wrapped"] == "DistributedDataParallel"
        assert seen["reduces"] is True
        single, double = seen["errors"]
        assert "strategy 'single'" in single and "2 ranks" in single
        assert f"reports rank {rank} of world size 3" in double
        assert f"rank {rank} of a group of 2" in double


def _collectives_per_epoch(rank: int, world_size: int) -> dict[int, list[str]]:
    from nn_handler.distributed.communicator import TorchCommunicator
    from tests.training_helpers import regression_data

    class Recording(TorchCommunicator):
        """Counts every collective the library makes through the Communicator."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def _do_all_reduce(self, tensor: Any, op: Any) -> Any:
            self.calls.append("all_reduce")
            return super()._do_all_reduce(tensor, op)

        def _do_all_reduce_async(self, tensor: Any, op: Any) -> Any:
            self.calls.append("all_reduce_async")
            return super()._do_all_reduce_async(tensor, op)

        def _do_broadcast(self, tensor: Any, src: int) -> Any:
            self.calls.append("broadcast")
            return super()._do_broadcast(tensor, src)

        def _do_all_gather(self, tensor: Any) -> Any:
            self.calls.append("all_gather")
            return super()._do_all_gather(tensor)

        def _do_gather(self, tensor: Any, dst: int) -> Any:
            self.calls.append("gather")
            return super()._do_gather(tensor, dst)

        def _do_barrier(self, timeout: Any) -> None:
            self.calls.append("barrier")
            super()._do_barrier(timeout)

    seen: dict[Any, list[str]] = {}
    # 2 and 10 optimizer steps per epoch on each rank; then 2 without the throughput monitor.
    for batch_size, monitor in ((10, True), (2, True), (10, False)):
        comm = Recording()
        with NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            communicator=comm,
            config={
                "loader": {"batch_size": batch_size},
                "trainer": {"progress_bar": False},
                "logging": {"monitor": monitor},
            },
        ) as handler:
            comm.calls.clear()  # construction (DDP's broadcast is not ours)
            handler.train(regression_data(n=40), regression_data(n=9), epochs=2)
        seen[40 // 2 // batch_size if monitor else "no monitor"] = comm.calls
    return seen


def test_the_library_adds_no_collective_per_optimizer_step_in_a_real_group(
    results: list[dict[str, Any]],
) -> None:
    """With DDP and no preemption check, what the library reduces per epoch does not grow
    with the steps (a per-micro-batch agreement would): only DDP's own reducer runs per step."""

    # Per epoch: the before_epoch hooks' agreement carrying the loaders' lengths (a tiny
    # all_gather), one all_reduce for the train loss, the throughput monitor's all_reduce
    # (after_train_epoch: a row per rank), one all_reduce for validation (its metrics with
    # the validation loop's failure flag), and one agreement for the after_validation and
    # after_epoch hooks carrying rank 0's stop decision. The first validation agrees on its
    # metric names by a hash, in one more small all_reduce before its values. Plus one
    # agreement per fit (before_train).
    def expected(monitor: bool) -> list[str]:
        epoch = ["all_gather", "all_reduce", *(["all_reduce"] if monitor else []), "all_reduce"]
        first = [*epoch[:-1], "all_reduce", epoch[-1], "all_gather"]
        return ["all_gather", *first, *epoch, "all_gather"]

    for seen in (r["collectives"] for r in results):
        assert seen[2] == seen[10], seen
        assert seen[2] == expected(monitor=True), seen[2]
        assert seen["no monitor"] == expected(monitor=False), seen["no monitor"]


def _monitor_on_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's samples take 10 ms each to load; rank 0 waits for it in the reduction."""
    import time

    from torch.utils.data import Dataset

    from nn_handler import ThroughputMonitor
    from tests.training_helpers import regression_data

    class SlowOnRankOne(Dataset[Any]):
        data = regression_data(n=40)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int) -> Any:
            if rank == 1:  # 40 ms a batch: far above a step's compute, even on a loaded machine
                time.sleep(0.01)
            return self.data[index]

    monitor = ThroughputMonitor(count_tokens=lambda batch: 10 * len(batch[0]))
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}},
        hooks=[monitor],
    ) as handler:
        handler.train(SlowOnRankOne(), epochs=1)
        return {"record": dict(handler.history.last), "verdict": monitor.last_verdict}


def _extras_on_two_ranks(rank: int, world_size: int) -> dict[str, float]:
    from nn_handler import Trainer
    from tests.training_helpers import regression_data

    class RankValues(Trainer):
        def training_step(self, batch: Any) -> dict[str, Any]:
            inputs, targets = batch
            loss = self.compute_loss(self.forward(inputs), targets)
            only_rank_0 = {"first": 7.0} if rank == 0 else {}
            return {"loss": loss, "rank": float(rank), **only_rank_0}

    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 5}, "trainer": {"progress_bar": False}},
        trainer_class=RankValues,
    ) as handler:
        handler.train(regression_data(n=40), epochs=1)
        return {k: v for k, v in handler.history.last.items() if k in ("train_rank", "train_first")}


def test_the_monitor_finds_the_straggler_and_the_exposed_reduction(
    results: list[dict[str, Any]],
) -> None:
    (fast, slow) = (r["monitor"]["record"] for r in results)
    verdicts = {r["monitor"]["verdict"] for r in results}
    (line,) = verdicts  # the same on every rank
    assert line.startswith("data-bound: ") and " waiting for batches on rank 1; " in line
    assert slow["data_wait_pct"] > 50.0 > fast["data_wait_pct"]
    # Rank 0 waits for rank 1 in DDP's gradient reduction, after its own backward ended.
    assert fast["exposed_comm_pct"] > 50.0 > slow["exposed_comm_pct"]
    assert fast["tokens_per_sec"] == slow["tokens_per_sec"]  # every rank's tokens, one rate
    for record in (fast, slow):
        assert {"samples_per_sec_rank", "tokens_per_sec_rank", "step_ms"} <= set(record)
        # 20 samples per rank, 10 tokens each: the global rate is twice a rank's (same wall).
        assert record["tokens_per_sec"] >= 1.9 * min(
            fast["tokens_per_sec_rank"], slow["tokens_per_sec_rank"]
        )


def test_extra_training_values_are_reduced_exactly_over_ranks(
    results: list[dict[str, Any]],
) -> None:
    for seen in (r["extras"] for r in results):
        # Equal samples per rank: the mean of 0 and 1; a key only rank 0 has: its own mean.
        assert seen == {"train_rank": 0.5, "train_first": 7.0}


def _tracked_per_rank(rank: int, world_size: int, folder: str) -> int:
    from tests.training_helpers import regression_data
    from tests.unit.test_tracked_state import Counter

    config = {
        "loader": {"batch_size": 5},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": folder, "resume": "auto"},
    }
    counter = Counter()
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        handler.trainer.track("counter", counter)
        counter.value = 100 + rank  # each rank's own
        handler.train(regression_data(n=20), epochs=1)
    restored = Counter()
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        handler.trainer.track("counter", restored)
        handler.train(regression_data(n=20), epochs=2)  # resumes after epoch 1
    return restored.value


def test_tracked_state_is_each_ranks_own_after_a_resume(results: list[dict[str, Any]]) -> None:
    assert [r["tracked"] for r in results] == [100, 101]


def _optimizer_step_hooks(rank: int, world_size: int) -> list[int]:
    from tests.training_helpers import regression_data
    from tests.unit.test_checkpoint_registry import StepCounter

    counter = StepCounter()
    config = {
        "loader": {"batch_size": 2},
        "trainer": {"progress_bar": False, "accumulate_grad_batches": 3},
    }
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[counter]) as h:
        h.train(regression_data(n=20), epochs=1)
    return counter.calls


def _mid_epoch_validations(rank: int, world_size: int) -> list[tuple[int, int, float]]:
    from tests.training_helpers import regression_data
    from tests.unit.test_val_check_interval import Validations

    seen = Validations()
    config = {"loader": {"batch_size": 2}, "trainer": {"progress_bar": False}}
    config["trainer"]["val_check_interval"] = 0.5  # type: ignore[index]
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[seen]) as h:
        h.train(regression_data(n=20), regression_data(n=7, seed=1), epochs=1)
    return seen.seen


def test_mid_epoch_validation_is_exact_and_the_same_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    first, second = (r["validations"] for r in results)
    # 10 samples per rank in batches of 2: every 2 batches (half of 5, rounded down), and at
    # the end of the epoch.
    assert [b for _, b, _ in first] == [2, 4, 5]
    assert first == second  # the 7 validation samples reduced exactly over both ranks


def test_after_optimizer_step_runs_once_per_step_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    # 10 samples per rank, batches of 2: 5 micro-batches, windows of 3 and 2 -> 2 steps.
    assert [r["optimizer_steps"] for r in results] == [[1, 2], [1, 2]]


def _gan_on_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from tests.gan_helpers import GANTrainer, TinyGAN, ring_data

    torch.manual_seed(10 + rank)  # different noise per rank: DDP must still keep one model
    with NNHandler(
        TinyGAN(),
        config={
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False, "find_unused_parameters": True},
        },
        trainer_class=GANTrainer,
    ) as handler:
        history = handler.train(ring_data(), epochs=2)
        return {
            "weights": torch.cat([p.detach().flatten() for p in handler.model.parameters()]),
            "steps": handler.trainer.state.global_step,
            "d_loss": history["train_d_loss"],
            "wrapped": type(handler.trainer.model).__name__,
        }


def test_a_gan_with_manual_optimization_stays_one_model_under_ddp(
    results: list[dict[str, Any]],
) -> None:
    first, second = (r["gan"] for r in results)
    assert first["wrapped"] == "DistributedDataParallel"
    assert first["steps"] == second["steps"] == 8  # 64 points, 2 ranks x batch 8, 2 epochs
    assert torch.equal(first["weights"], second["weights"])  # gradients averaged by DDP
    assert first["d_loss"] == second["d_loss"]  # reduced exactly over both ranks
