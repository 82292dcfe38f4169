"""The collectives ``nn-handler plan`` plans for one optimizer step (nn_handler/planning/
collectives.py) are those a real step makes, op for op and byte for byte: counted at torch's
c10d ops (a dispatch mode sees every one, DDP's C++ reducer's and FSDP2's included) during the
third optimizer step of a real NNHandler run in real gloo groups of 2 and 4 ranks: DDP (with
and without buffers to broadcast, with gradient accumulation), FSDP2 over 2 and 4 ranks (fp32
and bf16 mixed precision), HSDP 2 x 2, and the reproducible mode's exact sums (replicated with
and without BatchNorm, over FSDP2 and HSDP, with micro-batches that do not divide over the
ranks) (issue 75's calibration)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nn_handler import Hook, NNHandler
from nn_handler.planning.run_plan import plan_run
from tests.harness import run_group
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed

#: torch's c10d ops, by the plan's names.
OPS = {
    "c10d.allreduce_.default": "all_reduce",
    "c10d._allgather_base_.default": "all_gather",
    "c10d._reduce_scatter_base_.default": "reduce_scatter",
    "c10d.broadcast_.default": "broadcast",
}


class _Counted(TorchDispatchMode):
    """Every c10d op while ``on``: (op, group size, its first tensor's bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.seen: Counter[tuple[str, int, int]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on and str(func).startswith("c10d."):
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            boxed = next(a for a in args if type(a).__name__ == "ScriptObject")
            group = dist.ProcessGroup.unbox(boxed).size()  # the op's group: its size
            op = OPS.get(str(func), str(func))
            self.seen[op, group, first.numel() * first.element_size()] += 1
        return func(*args, **(kwargs or {}))


class _ThirdStep(Hook):
    """Turns the count on for the run's third optimizer step only: a steady step (DDP
    rebuilds its buckets at the second, broadcasting their order from rank 0)."""

    def __init__(self, counted: _Counted, micro_batches: int) -> None:
        self.counted, self.micro_batches, self.batches = counted, micro_batches, 0

    def before_step(self) -> None:
        self.batches += 1
        self.counted.on = 2 * self.micro_batches < self.batches <= 3 * self.micro_batches

    def after_step(self) -> None:
        self.counted.on = self.counted.on and self.batches < 3 * self.micro_batches


def _model(batchnorm: bool) -> nn.Module:
    return mlp(batchnorm=batchnorm)


def _model_and_inputs(batchnorm: bool, micro: int) -> tuple[nn.Module, torch.Tensor]:
    """The model and one micro-batch's inputs, for the plan's activations."""
    return mlp(batchnorm=batchnorm), torch.zeros(micro, 6)


#: The reproducible mode's steps: 4 micro-batches of 2 (a rank owns 2 of them at 2 ranks).
_EXACT = {"global_batch_size": 8, "micro_batch_size": 2}
CASES: dict[str, tuple[int, dict[str, Any], bool]] = {
    "ddp 2": (2, {"strategy": "ddp"}, False),
    "ddp 2, buffers, accumulation 2": (2, {"strategy": "ddp", "accumulate_grad_batches": 2}, True),
    "fsdp 2": (2, {"strategy": "fsdp", "fsdp": {"min_params": 50}}, False),
    "fsdp 2, bf16": (2, {"strategy": "fsdp", "fsdp": {"min_params": 50}}, False),
    "ddp 4": (4, {"strategy": "ddp"}, False),
    "fsdp 4": (4, {"strategy": "fsdp", "fsdp": {"min_params": 50}}, False),
    "hsdp 2 x 2": (4, {"strategy": "fsdp", "fsdp": {"min_params": 50, "replicate": 2}}, False),
    "reproducible 2": (2, {"reproducible": _EXACT}, False),
    "reproducible 2, batchnorm": (2, {"reproducible": _EXACT}, True),
    "reproducible fsdp 2": (
        2,
        {"strategy": "fsdp", "fsdp": {"min_params": 50}, "reproducible": _EXACT},
        False,
    ),
    "reproducible 4, 6 micro-batches": (
        4,
        {"reproducible": {**_EXACT, "global_batch_size": 12}},
        True,
    ),
    "reproducible hsdp 2 x 2": (
        4,
        {
            "strategy": "fsdp",
            "fsdp": {"min_params": 50, "replicate": 2},
            "reproducible": {**_EXACT, "global_batch_size": 12},
        },
        False,
    ),
}


def _config(name: str, trainer: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "loader": {"batch_size": 4},
        "trainer": {**trainer, "progress_bar": False},
    }
    if "bf16" in name:
        config["precision"] = "bf16"
    return config


def _count(rank: int, world_size: int) -> dict[str, Any]:
    """Each case of ``world_size`` ranks trained for real: its counted collectives, and the
    items of the memory plan its Trainer printed and checked (name, bytes)."""
    out: dict[str, Any] = {}
    for name, (world, trainer, batchnorm) in CASES.items():
        if world != world_size:
            continue
        counted = _Counted()
        micro = trainer.get("accumulate_grad_batches", 1)
        handler = NNHandler(
            _model(batchnorm), sgd, nn.CrossEntropyLoss(), config=_config(name, trainer),
            hooks=[_ThirdStep(counted, micro)],
        )  # fmt: skip
        try:
            with counted:
                handler.train(regression_data(n=4 * world * micro * 4), epochs=1)
        finally:
            handler.close()
        out[name] = sorted((op, size, nbytes, n) for (op, size, nbytes), n in counted.seen.items())
        plan = handler.trainer.memory.plan
        assert plan is not None
        out[f"{name} memory"] = [(item, size) for item, size, _ in plan.items]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_the_planned_collectives_of_a_step_are_those_a_real_step_makes(world: int) -> None:
    counted = run_group(_count, world, init="harness", timeout=180)
    assert all(c == counted[0] for c in counted)  # every rank alike
    for name, (w, trainer, batchnorm) in CASES.items():
        if w != world:
            continue
        mode = trainer.get("reproducible")
        micro = mode["micro_batch_size"] if mode else 4  # loader.batch_size
        model = functools.partial(_model_and_inputs, batchnorm, micro)
        plan = plan_run(_config(name, trainer), world, model, device_type="cpu", optimizer_slots=1)
        sizes = {"world": world, "shard": 2, "replicate": 2}  # HSDP's one case: 2 x 2
        planned = sorted((c.op, sizes[c.group] if c.group != "world" else world, c.bytes, c.count)
                         for c in plan.collectives)  # fmt: skip
        assert planned == counted[0][name], name
        assert planned, name  # a step of several ranks communicates
        # The memory per rank is the Trainer's own plan, item for item (its calibration
        # against measured peaks: benchmarks/memory_plan.py). The Trainer estimates the
        # activations only for a model with a meta twin (FSDP2, a meta-built one) and counts
        # no evaluation pass without validation data: the plan's extra items are those.
        assert plan.memory is not None
        planned_items = {item: size for item, size, _ in plan.memory.items}
        trainers = dict(counted[0][f"{name} memory"])
        assert {k: planned_items[k] for k in trainers} == trainers, name
        assert set(planned_items) - set(trainers) <= {"activations", "validation"}, name
