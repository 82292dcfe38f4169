"""Exact resume with loader workers that draw random augmentations, persistent or not.

The dataset adds noise from torch, ``random`` and NumPy in ``__getitem__`` (in the workers).
For both settings of persistent_workers, in one process and on 2 ranks: a run stopped after
epoch 1 and resumed, and a run SIGTERM'd mid-epoch and resumed, must end bit-identical to the
run that never stopped, and both settings must draw the same augmentations.
"""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from nn_handler import DistributedContext, HandlerConfig, NNHandler, TrainingPreempted
from tests.harness import run_group
from tests.resume_helpers import SigtermAt, adam, model, outcome, same, step_lr

pytestmark = pytest.mark.distributed

EPOCHS = 3


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """40 samples of 6 features plus fresh noise from all three generators on every read."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(6) * 0.1 + random.random() * 0.1 + float(np.random.rand()) * 0.1
        return self.x[index] + noise, self.y[index]


def _handler(folder: Path, world_size: int, persistent: bool, context: Any, **kw: Any) -> NNHandler:
    hooks = kw.pop("hooks", ())
    config = HandlerConfig.from_dict(
        {
            "loader": {
                "batch_size": 8 // world_size,
                "seed": 5,
                "num_workers": 2,
                "persistent_workers": persistent,
            },
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(folder), "every_n_steps": 2, **kw},
        }
    )
    return NNHandler(
        model(), adam, nn.CrossEntropyLoss(), step_lr, config=config, context=context, hooks=hooks
    )


def scenarios(base: Path, world_size: int, context: Any = None) -> dict[str, Any]:
    """For each persistent setting: uninterrupted, resumed at an epoch boundary, resumed
    after a SIGTERM mid-epoch 2 (after optimizer step 7)."""
    data, val = Augmented(), Augmented(n=16, seed=1)
    results: dict[str, Any] = {}
    for persistent in (True, False):
        folder = base / f"persistent{int(persistent)}"
        with _handler(folder / "full", world_size, persistent, context) as h:
            h.train(data, val, epochs=EPOCHS)
            results[f"full{int(persistent)}"] = outcome(h)
        with _handler(folder / "epoch", world_size, persistent, context) as h:
            h.train(data, val, epochs=1)
        with _handler(folder / "epoch", world_size, persistent, context, resume="auto") as h:
            h.train(data, val, epochs=EPOCHS)
            results[f"epoch{int(persistent)}"] = outcome(h)
        with (
            _handler(folder / "step", world_size, persistent, context, hooks=[SigtermAt(7)]) as h,
            pytest.raises(TrainingPreempted),
        ):
            h.train(data, val, epochs=EPOCHS)
        with _handler(folder / "step", world_size, persistent, context, resume="auto") as h:
            h.train(data, val, epochs=EPOCHS)
            results[f"step{int(persistent)}"] = outcome(h)
    return results


def _check(results: dict[str, Any], where: str) -> None:
    for persistent in (1, 0):
        full = results[f"full{persistent}"]
        for resumed in ("epoch", "step"):
            assert same(results[f"{resumed}{persistent}"], full), (
                f"{where}: persistent_workers={bool(persistent)}, resumed at {resumed}: "
                f"{results[f'{resumed}{persistent}']['history']} vs {full['history']}"
            )
    assert same(results["full1"], results["full0"]), f"{where}: persistent workers differ"


def test_resume_with_augmenting_workers_is_exact_in_one_process(tmp_path: Path) -> None:
    _check(scenarios(tmp_path, 1), "one process")


def _group(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    # The harness starts ranks with spawn, which their DataLoader workers would inherit (a
    # fresh interpreter per worker). Workers fork from a forkserver with torch preloaded
    # instead: as fast as fork, without inheriting the rank's gloo threads mid-operation (a
    # worker forked from a busy rank has crashed on this shared 2-core machine under load).
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "numpy", __name__])
    context = DistributedContext().setup()
    try:
        return scenarios(Path(folder), world_size, context)
    finally:
        context.teardown()


def test_resume_with_augmenting_workers_is_exact_on_two_ranks(tmp_path: Path) -> None:
    results = run_group(_group, 2, args=(str(tmp_path),), init="env", timeout=240, daemon=False)
    for rank in (0, 1):
        _check(results[rank], f"rank {rank}")
