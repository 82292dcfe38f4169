"""A model larger than one rank's memory budget, built on the meta device, trains on 2 and 4
real ranks (torchrun, gloo) within its memory plan: each rank's resident high-water mark over
the process's baseline (after the libraries' own first-run memory), during setup and during
training, is at most the plan's total (+15%), and the plan is within the budget while the
whole model's fp32 weights and Adam state are not. The numbers are printed (pytest -s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_command, torchrun_command

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "scripts" / "large_model_memory.py"
#: glibc returns freed blocks above this size to the system, so the high-water mark measures
#: the tensors, not the allocator's cache (benchmarks/README.md).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MiB = 2**20


def _run(tmp_path: Path, world: int, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / f"w{world}"
    command = torchrun_command(SCRIPT, str(out), *args, nproc=world)
    code, output = run_command(command, timeout=240, env=MALLOC)
    assert code == 0, output
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


@pytest.mark.parametrize(("world", "budget"), [(2, 100 * MiB), (4, 64 * MiB)])
def test_a_model_larger_than_the_budget_trains_within_its_plan(
    tmp_path: Path, world: int, budget: int
) -> None:
    reports = _run(tmp_path, world, "--budget", str(budget))
    for report in reports:
        print(
            f"rank {report['rank']}/{world}: setup peak {report['setup_peak'] / MiB:.1f} MiB, "
            f"training peak {report['peak'] / MiB:.1f} MiB, plan {report['plan'] / MiB:.1f} "
            f"MiB, budget {budget / MiB:.0f} MiB, whole model + Adam "
            f"{report['model_state'] / MiB:.0f} MiB"
        )
        assert report["model_state"] > budget  # the whole model would not fit one rank
        assert report["plan"] <= budget
        assert report["setup_peak"] <= report["items"]["parameters"] * 1.15 + 8 * MiB
        assert report["peak"] <= report["plan"] * 1.15
        assert report["peak"] >= report["plan"] * 0.7  # the plan does not overstate either
    assert len({tuple(r["losses"]) for r in reports}) == 1  # one loss on every rank


def test_activation_checkpointing_lowers_the_measured_peak(tmp_path: Path) -> None:
    """Batches of 1024 on 2 ranks: the activations dominate; full checkpointing keeps only
    each block's input, selective also its matrix products (the plan orders them so). The
    three modes are measured in turn by the same two ranks, each with a model of its own and
    the high-water mark reset before it (its setup and training peaks are its own)."""
    modes = ("none", "selective", "full")
    command = torchrun_command(
        SCRIPT,
        str(tmp_path / "run"),
        "--batch",
        "1024",
        "--steps",
        "2",
        "--checkpointing",
        ",".join(modes),
    )
    code, output = run_command(command, timeout=300, env=MALLOC)
    assert code == 0, output
    peak, plan = {}, {}
    for mode in modes:
        reports = [json.loads(Path(f"{tmp_path}/run.{mode}.{rank}").read_text()) for rank in (0, 1)]
        peak[mode], plan[mode] = max(r["peak"] for r in reports), reports[0]["plan"]
        print(f"{mode}: peak {peak[mode] / MiB:.1f} MiB, plan {plan[mode] / MiB:.1f} MiB")
        assert peak[mode] <= plan[mode] * 1.15
    assert plan["full"] < plan["selective"] < plan["none"]
    # Measured, each mode keeps less than none, full by far. Full against selective is not
    # asserted: in a fresh clone's full suite on two busy cores full's peak once measured
    # 110 MiB against selective's 105 (quiet, always about 79 and 137): their measured gap
    # depends on timing (FSDP2's prefetch, the allocator's reuse), not on the mode alone.
    assert peak["full"] < peak["none"] and peak["selective"] < peak["none"]
    assert peak["none"] - peak["full"] > 40 * MiB
