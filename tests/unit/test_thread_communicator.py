"""ThreadCommunicator, the in-process N-rank backend (and the worked example of writing one):
it meets the whole Communicator contract on 3 threads, its all_reduce returns new tensors
(which all_reduce_ must honour), and a rank that raises fails the run naming it."""

from __future__ import annotations

import pytest
import torch

from nn_handler import RankFailedError
from nn_handler.distributed.communicator import Communicator, run_in_threads
from tests.communicator_contract import run_all


def test_three_threads_meet_the_communicator_contract() -> None:
    names = run_in_threads(run_all, 3)
    assert len(names) == 3 and names[0] == names[2] and len(names[0]) >= 10


def test_in_place_reduction_uses_a_backend_that_returns_new_tensors() -> None:
    def reduce(comm: Communicator) -> list[float]:
        values = torch.full((2,), float(comm.rank + 1))
        comm.all_reduce_(values)  # the backend returns a new tensor: it must land in values
        return values.tolist()

    assert run_in_threads(reduce, 2) == [[3.0, 3.0], [3.0, 3.0]]


def test_a_rank_that_raises_fails_the_run_naming_it() -> None:
    def fails_on_rank_1(comm: Communicator) -> None:
        if comm.rank == 1:
            raise ValueError("rank 1 broke")
        comm.barrier()  # rank 0 waits here; released when rank 1 fails

    with pytest.raises(RankFailedError, match=r"rank\(s\) \[.*1.*\]") as info:
        run_in_threads(fails_on_rank_1, 2)
    assert "rank 1 broke" in str(info.value)


def test_a_handler_per_thread_trains_as_ranks_of_one_run() -> None:
    """NNHandler with an N-rank in-process double: loaders shard for N, the epoch's loss and
    the validation metrics are reduced over the N threads (the same numbers on each)."""
    from torch import nn

    from nn_handler import NNHandler, accuracy
    from tests.training_helpers import mlp, regression_data, sgd

    def train(comm: Communicator) -> tuple[int, dict[str, float]]:
        config = {"loader": {"batch_size": 5}, "trainer": {"progress_bar": False}}
        with NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            config=config,
            communicator=comm,
            metrics={"accuracy": accuracy},
        ) as handler:
            batches = len(handler.loaders.train_loader(regression_data(n=30)))
            history = handler.train(regression_data(n=30), regression_data(n=9), epochs=1)
            record = {k: v for k, v in history.last.items() if k in ("train_loss", "val_loss")}
            return batches, record

    results = run_in_threads(train, 3)
    assert [batches for batches, _ in results] == [2, 2, 2]  # 10 samples per rank, batch 5
    assert results[0][1] == results[1][1] == results[2][1]


def test_the_docs_example_runs_as_written() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    block = text.split("## Testing with N ranks in one process")[1].split("```python\n")[1]
    exec(compile(block.split("```")[0], "docs/distributed.md", "exec"), {})  # asserts inside


def test_a_validation_error_on_one_rank_only_stops_every_rank_at_once() -> None:
    """One validation sample: rank 1 has no batch and would not raise by itself; the error
    of rank 0 (an override that forgot update_metrics) reaches it instead of a hang."""
    from torch import nn

    from nn_handler import NNHandler, Trainer
    from tests.training_helpers import mlp, regression_data, sgd
    from tests.unit.test_trainer import _Counter

    class Forgets(Trainer):
        def validation_step(self, batch: object) -> dict[str, torch.Tensor]:
            inputs, targets = batch  # type: ignore[misc]
            return {"loss": self.compute_loss(self.forward(inputs), targets)}

    def evaluate(comm: Communicator) -> None:
        with NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            communicator=comm,
            metrics={"count": _Counter()},
            trainer_class=Forgets,
        ) as handler:
            handler.evaluate(regression_data(n=1))

    with pytest.raises(RankFailedError) as info:
        run_in_threads(evaluate, 2, timeout_s=20)
    assert "never called self.update_metrics" in str(info.value)
    assert "BrokenBarrierError" not in str(info.value), "a rank waited for the timeout"


def test_a_rank_that_never_joins_a_collective_breaks_it_after_the_timeout() -> None:
    def only_rank_0_waits(comm: Communicator) -> None:
        if comm.rank == 0:
            comm.barrier()

    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0\]") as info:
        run_in_threads(only_rank_0_waits, 2, timeout_s=0.5)
    assert "BrokenBarrierError" in str(info.value)
