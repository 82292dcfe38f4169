"""The reproducible mode with a sharded model, in real gloo groups (OMP_NUM_THREADS=1): the
CNN (BatchNorm, dropout, Adam) and the transformer block of tests/reproducible_helpers.py,
replicated on one rank, sharded by FSDP2 over 2 and 4 ranks and by HSDP 2x2, end with the same
SHA-256 of their whole weights, buffers, optimizer state and History; a sharded run stopped at
step 9 on 2 ranks and resumed on 3 ends with it too. A step's collectives are pinned: one int64
reduce-scatter (and an int64 all_reduce across HSDP's copies), FSDP2's own gradient
reduce-scatter never made."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nn_handler import DistributedContext, NNHandler
from nn_handler.errors import ConfigError
from tests.harness import run_group
from tests.memory_walk import held_tensor_bytes
from tests.reproducible_helpers import EPOCHS, WORKLOADS, full_digest, handler, sharded, train

pytestmark = pytest.mark.distributed

#: The layouts each world size trains: (name, FsdpConfig settings; None: replicated).
LAYOUTS: dict[int, dict[str, dict[str, Any] | None]] = {
    1: {"replicated": None},
    2: {"fsdp": {}},
    3: {},
    4: {"fsdp": {}, "hsdp": {"replicate": 2, "shard": 2}},
}


class _Counted:
    """Counts the calls of torch.distributed's reduce-scatters and all_reduce while it
    is entered (the real functions are called: FSDP2 and the mode reach them through the
    module ``torch.distributed``), by dtype."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _wrap(self, name: str) -> Callable[..., Any]:
        real = getattr(dist, name)

        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls[f"{name}({str(tensor.dtype).removeprefix('torch.')})"] += 1
            return real(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> _Counted:
        names = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
        self._real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
        for name in self._real:
            setattr(dist, name, self._wrap(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)


def _group(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    context = DistributedContext().setup()
    out: dict[str, Any] = {}
    for layout, fsdp in LAYOUTS[world_size].items():
        for name in WORKLOADS:
            with handler(name, context, **sharded(name, fsdp)) as h, _Counted() as counted:
                train(h, name)
                out[f"{name}_{layout}"] = full_digest(h)
                exact = h.trainer.mode.exact  # type: ignore[attr-defined]
                steps = h.trainer.state.global_step
                out[f"{name}_{layout}_calls"] = (dict(counted.calls), steps, exact.rescaled_steps)
                plan = h.trainer.memory.plan
                planned = {item: size for item, size, _ in plan.items} if plan else {}
                # The slots (a row per micro-batch: samples, loss, statistics, maxima), not
                # in the plan: in the sum, and sharded in each shard's row of the
                # reduce-scatter's input and in what it receives.
                width = 2 + len(exact.norms.layers) + exact.norms.width + len(exact.params)
                shards = None if fsdp is None else fsdp.get("shard", world_size)
                copies = 1 if shards is None else 2 + shards
                slots = 8 * width * exact.config.micro_batches * copies
                params = list(h.trainer.module.parameters())
                leave_out = params + [p.grad for p in params if p.grad is not None]
                walked = held_tensor_bytes(exact, leave_out)
                if fsdp is not None:  # made unsharded in each backward, freed after the step
                    walked += sum(p.numel() * p.element_size() for p in params)
                out[f"{name}_{layout}_memory"] = (exact.held_bytes(), planned, slots, walked)
    saved = Path(folder)
    if world_size == 2:
        out["too_few"] = _too_few_micro_batches(context)
    if world_size == 2:  # stopped mid-epoch (step 9 of 12), sharded over 2 ranks
        with handler("cnn", context, folder=saved, max_steps=9, **sharded("cnn", {})) as h:
            train(h, "cnn")
            out["stopped_at"] = h.trainer.state.global_step
    if world_size == 3:  # resumed at step 9, sharded over 3 ranks
        with handler("cnn", context, folder=saved, **sharded("cnn", {})) as h:
            h.resume(_latest(saved))
            train(h, "cnn")
            out["resumed"] = full_digest(h)
    return out


def _too_few_micro_batches(context: DistributedContext) -> str:
    """One micro-batch a step for 2 ranks: sharded, rank 1 would have no forward to gather
    the parameters in while rank 0 runs its own."""
    model = WORKLOADS["cnn"][0]()
    config = {
        "trainer": {
            "progress_bar": False,
            "reproducible": {"global_batch_size": 4, "micro_batch_size": 4},
            **sharded("cnn", {}),
        }
    }
    try:
        NNHandler(model, lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(),
                  config=config, context=context)  # fmt: skip
    except ConfigError as error:
        return str(error)
    return "accepted"


def _latest(folder: Path) -> Path:
    found = sorted(p for p in folder.iterdir() if p.name.startswith("ckpt-") and "s00000009" in
                   p.name)  # fmt: skip
    assert found, sorted(p.name for p in folder.iterdir())
    return found[0]


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[int, list[dict[str, Any]]]]:
    with tempfile.TemporaryDirectory() as folder:
        yield {w: run_group(_group, w, args=(folder,), timeout=300) for w in (1, 2, 3, 4)}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_sharded_layouts_train_the_bits_of_one_replicated_rank(
    runs: dict[int, list[dict[str, Any]]], name: str
) -> None:
    expected = runs[1][0][f"{name}_replicated"]
    found = {(w, layout): runs[w][0][f"{name}_{layout}"] for w in (2, 4) for layout in
             LAYOUTS[w]}  # fmt: skip
    assert set(found.values()) == {expected}, found


def test_fewer_micro_batches_than_ranks_is_refused_when_sharded(
    runs: dict[int, list[dict[str, Any]]],
) -> None:
    for result in runs[2]:
        assert (
            "a step has 1 micro-batches (global_batch_size / micro_batch_size) for 2 ranks"
            in (result["too_few"])
        ), result["too_few"]
        assert "make global_batch_size at least 2 x micro_batch_size" in result["too_few"]


def test_a_sharded_run_stopped_on_2_ranks_and_resumed_on_3_ends_with_the_same_bits(
    runs: dict[int, list[dict[str, Any]]],
) -> None:
    assert [r["stopped_at"] for r in runs[2]] == [9, 9]
    assert runs[3][0]["resumed"] == runs[1][0]["cnn_replicated"]


def test_a_sharded_step_makes_one_int64_reduce_scatter_and_no_float_one(
    runs: dict[int, list[dict[str, Any]]],
) -> None:
    """Per step: one int64 reduce-scatter (FSDP) and, with HSDP, one int64 all_reduce across
    the copies; one more of each on a rescaled step; FSDP2's own (floating-point) gradient
    reduce-scatter never. The other int64 all_reduces: the optimizer's agreement on finite
    gradients (each rank checks its shard: one flag a step) and the exact validation means
    (one an epoch); the float64 ones: the first step's agreement on the maxima and the
    throughput readings (one an epoch)."""
    for w in (2, 4):
        for layout in LAYOUTS[w]:
            for name in WORKLOADS:
                for rank, result in enumerate(runs[w]):
                    calls, steps, rescales = result[f"{name}_{layout}_calls"]
                    sums = steps + rescales
                    copies = sums if layout == "hsdp" else 0
                    assert calls == {
                        "reduce_scatter_single(int64)": sums,
                        "all_reduce(int64)": steps + EPOCHS + copies,
                        "all_reduce(float64)": 1 + EPOCHS,
                    }, (w, layout, name, rank, calls)
                    assert steps == 6 * EPOCHS and rescales <= steps // 4, (w, layout, name)


def test_the_memory_plan_states_the_buffers_the_mode_holds(
    runs: dict[int, list[dict[str, Any]]],
) -> None:
    """The plan's "reproducible mode" item against the bytes a rank's exact sum holds after
    training (its accumulator and workspace, and sharded: the reduce-scatter's buffers and
    FSDP2's unsharded gradients): what is held beyond the slots (a row per micro-batch, not
    in the plan) within 10% above the plan (the shards' padding)."""
    for w, group in runs.items():
        for layout in LAYOUTS[w]:
            for name in WORKLOADS:
                for rank, result in enumerate(group):
                    held, planned, slots, walked = result[f"{name}_{layout}_memory"]
                    item = planned["reproducible mode"]
                    if layout != "replicated":  # FSDP2's plan is whole: activations too
                        assert planned["activations"] > 0, (w, layout, name)
                    where = (w, layout, name, rank, held, slots, item, walked)
                    assert item <= held - slots <= 1.1 * item, where
                    # The accounting against what the mode's objects hold after training,
                    # found by walking them (tests/memory_walk.py), plus sharded the whole
                    # gradients of a step's backward: nothing left out but a few bytes a
                    # tensor (the scales, the tensors' sizes).
                    assert held <= walked <= held + 512, where
