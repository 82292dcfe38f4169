"""A slow step is not a stall (the fault campaign's item 6), on 2 real gloo ranks with a 1 s
stall_timeout: a training step that takes 2.5 s on every rank trains on with one warning on
one rank; rank 0 working 2.5 s inside ``comm.patient()`` in a hook (the example of
docs/distributed.md, run as written) trains on with no report. A rank that is missing without
``patient`` is still reported (tests/distributed/test_stall_watchdog.py, the 'hook' scenario;
the decision itself: tests/unit/test_watchdog.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from torch import nn

from nn_handler import NNHandler, Trainer
from tests.harness import run_group
from tests.training_helpers import mlp, regression_data

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parents[2]
SLOW_S = 2.5
CONFIG = {
    "loader": {"batch_size": 4},
    "trainer": {"progress_bar": False},
    "distributed": {"stall_timeout": 1.0, "timeout": 60.0},
}


class SlowStep(Trainer):
    """Every rank's third step takes SLOW_S seconds (inside the synchronised step)."""

    def training_step(self, batch: Any) -> Any:
        if self.state.global_step == 2:
            time.sleep(SLOW_S)
        return super().training_step(batch)


def _docs_hook() -> type:
    """The hook of docs/distributed.md's 'Long work on one rank', executed as written, its
    long work a sleep of SLOW_S seconds."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    block = re.search(r"```python\n(.*?class UploadOnRankZero.*?)```", text, re.S)
    assert block is not None, "the example is gone from docs/distributed.md"
    namespace: dict[str, Any] = {"write_large_artifact": lambda model: time.sleep(SLOW_S)}
    exec(block.group(1), namespace)
    hook: type = namespace["UploadOnRankZero"]
    return hook


def _ranks(rank: int, world: int) -> dict[str, Any]:
    seen: list[str] = []
    logger.enable("nn_handler")
    logger.add(seen.append, level="WARNING", format="{message}")
    out: dict[str, Any] = {}
    data = regression_data(n=32)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    start = time.monotonic()
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=CONFIG, trainer_class=SlowStep) as h:
        h.train(data, epochs=1)
        out["slow_steps"] = h.trainer.state.global_step
    out["slow_seconds"] = time.monotonic() - start
    out["slow_warnings"] = [w for w in seen if "stall" in w]
    seen.clear()
    hooks = [_docs_hook()()]
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=CONFIG, hooks=hooks) as h:
        h.train(data, epochs=2)
        out["patient_epochs"] = h.trainer.state.epoch
    out["patient_warnings"] = [w for w in seen if "stall" in w]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_group(_ranks, 2, timeout=120)


def test_a_step_slower_than_the_stall_timeout_on_every_rank_trains_on(
    ranks: list[dict[str, Any]],
) -> None:
    for seen in ranks:
        assert seen["slow_steps"] == 4 and seen["slow_seconds"] > SLOW_S
    said = [w for seen in ranks for w in seen["slow_warnings"]]
    assert len(said) == 1, said  # one line, by one rank
    assert re.search(
        r"training step .* has lasted \d\.\d s, longer than stall_timeout \(1 s\), but every "
        r"rank is in it: a slow step, not a stall; waiting on",
        said[0],
    ), said[0]


def test_one_rank_working_inside_patient_is_waited_for(ranks: list[dict[str, Any]]) -> None:
    for seen in ranks:
        assert seen["patient_epochs"] == 2
    said = [w for seen in ranks for w in seen["patient_warnings"]]
    assert len(said) == 1 and "rank 0 is working inside Communicator.patient()" in said[0], said
