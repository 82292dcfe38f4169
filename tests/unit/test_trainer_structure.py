"""The Trainer's shape, pinned: parts it owns instead of mixins, a short path from
``NNHandler.train`` to ``loss.backward``, privates that stay in their file, and a subclass
whose own attributes cannot silently break the loop."""

from __future__ import annotations

import ast
import inspect
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nn_handler
from nn_handler import NNHandler
from nn_handler.errors import ConfigError
from nn_handler.training.facade import TrainerFacade
from nn_handler.training.trainer import Trainer
from tests.training_helpers import mlp, regression_data, sgd
from tests.unit.test_tracked_state import Counter

PACKAGE = Path(nn_handler.__file__).parent


def test_the_trainer_has_one_documented_base_and_at_most_40_methods() -> None:
    assert Trainer.__mro__ == (Trainer, TrainerFacade, object)
    own = [
        name
        for name, value in vars(Trainer).items()
        if inspect.isfunction(value) or isinstance(value, property)
    ]
    assert len(own) <= 40, sorted(own)
    # The facade holds no state and no loop: views, delegations and the attribute guard.
    helpers = [n for n, v in vars(TrainerFacade).items() if n.startswith("_") and callable(v)]
    assert helpers == ["__setattr__"], helpers


def _backward_stack(handler: NNHandler) -> list[str]:
    """The nn_handler frames on the stack when autograd reaches the model's first weight."""
    seen: list[list[str]] = []
    weight = next(handler.trainer.module.parameters())

    def record(grad: torch.Tensor) -> torch.Tensor:
        if not seen:
            frames = traceback.extract_stack()
            seen.append(
                [f"{Path(f.filename).name}:{f.name}" for f in frames if str(PACKAGE) in f.filename]
            )
        return grad

    weight.register_hook(record)
    handler.train(regression_data(n=8), epochs=1)
    return seen[0]


def test_from_train_to_loss_backward_is_five_nn_handler_frames() -> None:
    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        stack = _backward_stack(handler)
    assert stack == [
        "handler.py:train",
        "trainer.py:fit",
        "trainer.py:train_epoch",
        "trainer.py:run_step",
        "optimization.py:backward",
    ]


def test_manual_backward_is_five_frames_too() -> None:
    class Manual(Trainer):
        automatic_optimization = False

        def training_step(self, batch: Any) -> torch.Tensor:
            optimizer = self.optimizers()[0]
            optimizer.zero_grad()
            inputs, targets = batch
            loss = nn.functional.cross_entropy(self.forward(inputs), targets)
            self.manual_backward(loss)
            optimizer.step()
            return loss

    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), sgd, config=config, trainer_class=Manual) as handler:
        stack = _backward_stack(handler)
    assert stack[-1] == "trainer.py:manual_backward" and len(stack) == 5, stack


def _private_reads_outside_their_file() -> list[str]:
    """``self._name`` read in a file that never assigns ``self._name``, and ``x._name`` of
    anything that is not ``self`` or ``cls``, in the training layer (where the Trainer's
    parts live) and the handler."""
    found: list[str] = []
    files = [*sorted((PACKAGE / "training").glob("*.py")), PACKAGE / "handler.py"]
    for path in files:
        tree = ast.parse(path.read_text())
        assigned = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        }
        methods = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__"):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                if node.attr not in assigned and node.attr not in methods:
                    found.append(f"{path.name}:{node.lineno} self.{node.attr}")
            elif owner == "trainer" or (
                isinstance(node.value, ast.Attribute) and node.value.attr == "trainer"
            ):
                found.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
    return found


def test_no_private_attribute_is_used_outside_the_file_that_owns_it() -> None:
    assert _private_reads_outside_their_file() == []


class GanLike(Trainer):
    """A research subclass with ordinary attribute names of its own."""

    automatic_optimization = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = 0
        self.losses: list[float] = []
        self.state_of_gan = {"phase": "warmup"}

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        self.optimizer_g = torch.optim.SGD(self.model.parameters(), lr=0.05)
        return [self.optimizer_g], None

    def training_step(self, batch: Any) -> torch.Tensor:
        self.optimizer_g.zero_grad()
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.forward(inputs), targets)
        self.manual_backward(loss)
        self.optimizer_g.step()
        self.step += 1
        self.losses.append(float(loss))
        return loss


def test_a_subclass_with_its_own_ordinary_attributes_trains_and_counts() -> None:
    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), config=config, trainer_class=GanLike) as handler:
        before = {k: v.clone() for k, v in handler.trainer.module.state_dict().items()}
        history = handler.train(regression_data(n=16), epochs=2)
        trainer = handler.trainer
        assert isinstance(trainer, GanLike)
        assert trainer.step == 8 == trainer.state.global_step and len(trainer.losses) == 8
        assert trainer.optimizer is trainer.optimizer_g and len(history) == 2
        after = trainer.module.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "name", ["state", "history", "hooks", "optimization", "model", "memory", "mode"]
)
def test_assigning_one_of_the_trainers_own_attributes_is_a_clear_error(name: str) -> None:
    trainer = Trainer(mlp(), sgd, nn.CrossEntropyLoss())
    with pytest.raises(ConfigError, match=rf"Trainer\.{name} is the Trainer's own attribute"):
        setattr(trainer, name, object())


def test_setting_one_before_the_trainer_is_built_is_a_clear_error() -> None:
    class Early(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.history = []  # would be replaced by the Trainer's History without a word
            super().__init__(*args, **kwargs)

    with pytest.raises(ConfigError, match=r"Early set history before Trainer.__init__"):
        Early(mlp(), sgd, nn.CrossEntropyLoss())


class TracksInConfigureOptimizers(Trainer):
    """docs/checkpoints.md names configure_optimizers as a place to call track."""

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        self.counter = Counter()
        self.track("counter", self.counter)
        return super().configure_optimizers(optimizer, scheduler)


class TracksInInit(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = Counter()
        self.track("counter", self.counter)


@pytest.mark.parametrize("trainer_class", [TracksInConfigureOptimizers, TracksInInit])
def test_track_works_at_every_documented_call_site(
    trainer_class: type[Trainer], tmp_path: Path
) -> None:
    trainer: Any = trainer_class(mlp(), sgd, nn.CrossEntropyLoss())
    trainer.counter.value = 5
    path = trainer.save_checkpoint(tmp_path / "c.pt")
    fresh: Any = trainer_class(mlp(), sgd, nn.CrossEntropyLoss())
    fresh.resume(path)
    assert fresh.counter.value == 5 and "counter" in fresh.tracked


def test_track_right_after_building_the_handler(tmp_path: Path) -> None:
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as handler:
        counter = Counter()
        handler.trainer.track("counter", counter)
        counter.value = 3
        path = handler.save(tmp_path / "h.pt")
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as again:
        restored = Counter()
        again.trainer.track("counter", restored)
        again.resume(path)
        assert restored.value == 3


def test_an_optimizer_holding_a_parameter_outside_the_model_resumes(tmp_path: Path) -> None:
    """Why single-file checkpoints of one device or DDP keep ``optimizer.state_dict()``
    instead of DCP's get_optimizer_state_dict view: DCP's view refuses (KeyError) an optimizer
    with a parameter the module does not own, such as a learnable temperature."""
    temperature = nn.Parameter(torch.ones(()))

    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam([*params, temperature], lr=0.01)

    class Tempered(Trainer):
        def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
            return nn.functional.cross_entropy(outputs / temperature, targets)

    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), optimizer, config=config, trainer_class=Tempered) as handler:
        handler.train(regression_data(n=8), epochs=1)
        path = handler.save(tmp_path / "t.pt")
        moments = handler.trainer.optimizer.state_dict()["state"][len(list(mlp().parameters()))]
    with NNHandler(mlp(), optimizer, config=config, trainer_class=Tempered) as again:
        again.resume(path)
        restored = again.trainer.optimizer.state_dict()["state"]
        index = len(list(mlp().parameters()))
        assert torch.equal(restored[index]["exp_avg"], moments["exp_avg"])


def test_docs_list_exactly_the_trainers_own_attributes() -> None:
    """docs/training.md's table of what a subclass may use is the Trainer's attribute list."""
    text = (PACKAGE.parent / "docs" / "training.md").read_text()
    table = text.split("| attribute | what it is |", 1)[1].split("\n\n", 1)[0]
    documented: set[str] = set()
    for row in table.splitlines()[2:]:
        documented |= {name.strip("` ") for name in row.split("|")[1].split(",")}
    assert documented == set(TrainerFacade.__annotations__)


def test_metrics_without_a_loss_evaluate() -> None:
    """Inference after training: evaluate() with metrics and no loss_fn gives the metrics."""
    from nn_handler import accuracy

    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), config=config, metrics={"accuracy": accuracy}) as handler:
        results = handler.evaluate(regression_data(n=12))
    assert set(results) == {"accuracy"} and 0.0 <= results["accuracy"] <= 1.0


def test_seed_everything_repeats_the_initial_weights_and_draws() -> None:
    import random

    import numpy as np

    from nn_handler import seed_everything

    draws = []
    for _ in range(2):
        assert seed_everything(7) == 7
        draws.append((random.random(), float(np.random.rand()), nn.Linear(3, 2).weight.sum()))
    assert draws[0] == draws[1]
    with pytest.raises(ConfigError, match="seed_everything needs an int"):
        seed_everything(-1)


def test_an_evaluator_needs_a_strategy_that_has_set_up_the_model() -> None:
    from nn_handler.config.training import PrecisionConfig, TrainerConfig
    from nn_handler.distributed.communicator import NullCommunicator
    from nn_handler.strategies import SingleDeviceStrategy
    from nn_handler.training.evaluation import Evaluator
    from nn_handler.training.hooks import HookList
    from nn_handler.training.optimization import Optimization
    from nn_handler.training.precision import Precision
    from nn_handler.training.state import TrainerState

    config, device = TrainerConfig(), torch.device("cpu")
    strategy = SingleDeviceStrategy(NullCommunicator(), device, config)  # setup() not called
    optimization = Optimization(
        config, Precision(PrecisionConfig(), device), strategy, TrainerState(), None
    )
    with pytest.raises(ConfigError, match="needs a strategy whose setup"):
        Evaluator(config, strategy, optimization, HookList([], None), None, lambda _m: None)


def test_every_attribute_the_trainer_sets_is_protected_or_private() -> None:
    """A new part added to Trainer.__init__ without its annotation on TrainerFacade would be
    silently replaceable by a subclass (memory and reproducible were)."""
    from nn_handler.training.facade import OWN_ATTRIBUTES

    trainer = Trainer(mlp(), sgd, nn.CrossEntropyLoss())
    public = {name for name in vars(trainer) if not name.startswith("_")}
    assert public - OWN_ATTRIBUTES == {"training_failed"}
