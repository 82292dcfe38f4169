"""The Strategy seam and the one world view, in one process: 'auto' picks the single-device
strategy, 'ddp' without a process group and an N-rank 'single' are clear errors, and a
communicator double of N ranks gives loaders sharded for N."""

from __future__ import annotations

import pytest
from torch import nn

from nn_handler import ConfigError, NNHandler, NullCommunicator
from nn_handler.strategies import DDPStrategy, SingleDeviceStrategy
from tests.harness import free_port
from tests.training_helpers import mlp, regression_data, sgd


class FakeWorld(NullCommunicator):
    """A test double that says it is rank ``rank`` of ``world_size`` (collectives unused)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self._fake = (rank, world_size)

    @property
    def rank(self) -> int:
        return self._fake[0]

    @property
    def world_size(self) -> int:
        return self._fake[1]


def test_auto_is_the_single_device_strategy_in_one_process() -> None:
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as handler:
        assert isinstance(handler.trainer.strategy, SingleDeviceStrategy)
        assert handler.trainer.model is handler.trainer.module


def test_ddp_without_a_process_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="strategy 'ddp' needs an initialised process group"):
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": {"strategy": "ddp"}})


def test_single_on_several_ranks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"strategy 'single'.*3 ranks"):
        NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            communicator=FakeWorld(0, 3),
            config={"trainer": {"strategy": "single"}},
        )


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_double_of_n_ranks_shards_the_loaders_for_n(rank: int) -> None:
    data = regression_data(n=30)
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        communicator=FakeWorld(rank, 3),
        config={"loader": {"batch_size": 5, "shuffle": False}},
    ) as handler:
        assert (handler.rank, handler.world_size) == (rank, 3)
        assert handler.loaders.info.world_size == 3 and handler.loaders.info.rank == rank
        evaluation = handler.loaders.eval_loader(data)
        assert list(evaluation.indices) == list(range(rank, 30, 3))  # every third sample
        assert len(handler.loaders.train_loader(data)) == 2  # 10 samples per rank, batch 5
        assert isinstance(handler.trainer.strategy, SingleDeviceStrategy)  # no group to DDP


def test_strategies_are_named_as_the_config_names_them() -> None:
    assert (SingleDeviceStrategy.name, DDPStrategy.name) == ("single", "ddp")


def test_configure_optimizers_runs_once_the_trainer_parts_exist() -> None:
    from nn_handler import Trainer

    seen: dict[str, object] = {}

    class Reads(Trainer):
        def configure_optimizers(self, optimizer: object, scheduler: object) -> object:
            seen["parts"] = (self.state.global_step, len(self.history), len(self.hooks.hooks))
            seen["strategy"] = self.strategy.name
            return super().configure_optimizers(optimizer, scheduler)  # type: ignore[arg-type]

    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), trainer_class=Reads) as handler:
        assert handler.trainer.optimizer is not None
    assert seen == {"parts": (0, 0, 1), "strategy": "single"}  # the ThroughputMonitor


def test_importing_nn_handler_leaves_fsdp_and_dcp_unimported() -> None:
    """torch.distributed.checkpoint takes about a second to import, torch.distributed.tensor
    (with sympy) 0.4 s, torchft (with opentelemetry and protobuf) 0.1 s, in every process a
    run spawns: they are imported when strategy 'fsdp' is chosen, a DTensor is met or a
    fault-tolerant member starts, not with nn_handler."""
    import subprocess
    import sys

    heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "torchft")
    probe = (
        "import sys, nn_handler, nn_handler.strategies as s; "
        f"print(sorted(m for m in {(*heavy, 'nn_handler.strategies.fsdp')!r} "
        "if m in sys.modules)); s.FSDP2Strategy; print('nn_handler.strategies.fsdp' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["[]", "True"], done.stdout + done.stderr


def test_fsdp_in_one_process_names_the_setting_that_makes_a_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun --nproc-per-node=1: one rank, no group by default; the error says which
    setting makes one (and distributed: {enabled: true} does)."""
    for name, value in {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "t",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"set distributed: \{enabled: true\}") as error:
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": {"strategy": "fsdp"}})
    # The fix as it is written in a YAML file and in a dict, ready to paste (issue 69, 14).
    assert "    distributed:\n      enabled: true\n" in str(error.value)
    assert '"distributed": {"enabled": True}' in str(error.value)
    config = {"trainer": {"strategy": "fsdp"}, "distributed": {"enabled": True}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        assert handler.trainer.strategy.name == "fsdp"
        history = handler.train(regression_data(n=16), epochs=1)
        assert len(history) == 1
