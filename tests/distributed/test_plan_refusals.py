"""``nn-handler plan`` finds the launch's refusals without launching (issue 75): for configs
that a real launch of two ranks refuses (an HSDP mesh whose product is not the world, a
sharded step with fewer micro-batches than ranks, strategy 'single' over two ranks, FSDP2's CPU
offload on CPU ranks, a global
batch that is no multiple of the micro-batch, fault tolerance with FSDP, a memory budget too
small, an async save of single files), the plan's refusals are exactly the ConfigErrors the
real NNHandler raises on each rank of a real gloo group, word for word; a config the launch
takes (a sharded model with a parameter of fewer rows than shards among them), the plan takes
too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nn_handler import NNHandler
from nn_handler.errors import ConfigError
from nn_handler.planning import plan_run
from tests.harness import run_group
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed

_FSDP_EXACT = {"strategy": "fsdp", "reproducible": {"global_batch_size": 4, "micro_batch_size": 1}}
CASES: dict[str, dict[str, Any]] = {
    "mesh": {"strategy": "fsdp", "fsdp": {"replicate": 2, "shard": 2}},
    "micro-batches": {
        "strategy": "fsdp",
        "reproducible": {"global_batch_size": 4, "micro_batch_size": 4},
    },
    "single": {"strategy": "single"},
    "cpu offload on the cpu": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}},
    "not a multiple": {"reproducible": {"global_batch_size": 5, "micro_batch_size": 2}},
    "memory": {"memory_budget": "1KB"},
    "fault tolerance with fsdp": {
        **_FSDP_EXACT,
        "fault_tolerance": {"lighthouse": "http://127.0.0.1:1"},
    },
    "taken": _FSDP_EXACT,
    # FSDP2 pads a parameter with fewer rows than shards (some ranks hold none of it): the
    # launch takes it, so the plan does too.
    "shard dim below the ranks": {"strategy": "fsdp"},
}
#: The cases whose model has a parameter of one row (the rest train ``mlp()``).
NARROW = {"shard dim below the ranks"}
#: Cases whose culprit is outside ``trainer``: (the trainer's section, the others).
OUTSIDE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "async single files": ({"strategy": "ddp"}, {"checkpoint": {"async_save": True}}),
}


def _narrow() -> nn.Module:
    """A model with a weight of one row: fewer rows than the two shards."""
    return nn.Sequential(nn.Linear(6, 1), nn.Tanh(), nn.Linear(1, 3))


def _config(trainer: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {"loader": {"batch_size": 4}, "trainer": {**trainer, "progress_bar": False}, **sections}


def _cases(folder: str) -> dict[str, dict[str, Any]]:
    """Every case's config (a checkpoint folder of ``folder``'s where one is needed)."""
    configs = {name: _config(trainer) for name, trainer in CASES.items()}
    for name, (trainer, sections) in OUTSIDE.items():
        checkpoint = {**sections.get("checkpoint", {}), "dir": f"{folder}/{len(configs)}"}
        configs[name] = _config(trainer, **{**sections, "checkpoint": checkpoint})
    return configs


def _launch(rank: int, world_size: int, folder: str) -> dict[str, str | None]:
    """Each case launched for real in this group: its ConfigError's text, None if it trained."""
    raised: dict[str, str | None] = {}
    for name, config in _cases(folder).items():
        try:
            model = _narrow() if name in NARROW else mlp()
            handler = NNHandler(model, sgd, nn.CrossEntropyLoss(), config=config)
            try:
                handler.train(regression_data(), epochs=1)
                raised[name] = None
            finally:
                handler.close()
        except ConfigError as error:
            raised[name] = str(error)
    return raised


def test_the_plan_refuses_exactly_what_a_real_launch_of_two_ranks_refuses(
    tmp_path: Path,
) -> None:
    real = run_group(_launch, 2, args=(str(tmp_path),), init="harness", timeout=120)
    assert real[0] == real[1]  # every rank refuses alike
    for name, config in _cases(str(tmp_path)).items():
        model = _narrow if name in NARROW else mlp
        plan = plan_run(config, 2, model, device_type="cpu", optimizer_slots=1.0)
        planned = [refusal.message for refusal in plan.refusals]
        expected = [] if real[0][name] is None else [real[0][name]]
        assert planned == expected, name
    taken = {"taken", *NARROW}
    assert all(real[0][name] is None for name in taken)
    assert all(real[0][name] is not None for name in _cases(str(tmp_path)) if name not in taken)
