"""The benchmark scripts run (quick mode) and write the fields the report reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_command

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def run_quick(script: str, tmp_path: Path) -> dict[str, Any]:
    """Run a benchmark in --quick mode; its JSON results, with the shared fields checked."""
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out)]
    code, output = run_command(command, timeout=180)
    assert code == 0, output
    results: dict[str, Any] = json.loads(out.read_text())
    assert {"machine", "command"} <= set(results) and results["machine"]["torch"]
    return results


@pytest.mark.distributed
def test_communicator_overhead_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("communicator_overhead.py", tmp_path)
    assert {"machine", "command", "single_process_us_per_call", "gloo_world2_all_reduce"} <= set(
        results
    )
    assert all(v > 0 for v in results["single_process_us_per_call"].values())
    assert [row["numel"] for row in results["gloo_world2_all_reduce"]] == [4, 2**20]
    for row in results["gloo_world2_all_reduce"]:
        comparisons = [value for value in row.values() if isinstance(value, dict)]
        assert len(comparisons) == 2
        for c in comparisons:
            assert c["ratio_min"] <= c["ratio_median"] <= c["ratio_max"]


@pytest.mark.distributed
def test_loader_cache_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("loader_cache.py", tmp_path)
    assert results["world_size"] == 2 and len(results["per_rank"]) == 2
    for timings in results["per_rank"]:
        assert set(timings) == {"distributed_w0", "distributed_w1", "rank_cached"}
        batches = {v["batches_per_epoch"] for v in timings.values()}
        assert batches == {16}, "every variant gives each rank the same number of batches"
    for ratio in results["ratios"]:
        assert ratio["later_epoch_speedup_vs_distributed_w0"] > 0


def test_ema_update_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("ema_update.py", tmp_path)
    assert results["tensors"] == 200
    for row in results["results"].values():
        low, high = row["ratio_spread"]
        assert low <= row["ratio_to_bare_median"] <= high and row["ms_per_update"] > 0
    assert set(results["results"]) >= {"foreach_lerp (bare)", "nn_handler ModelEma.update"}


@pytest.mark.distributed
def test_training_step_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("training_step.py", tmp_path)
    assert [row["case"] for row in results["results"]] == ["tiny_mlp", "small_cnn"]
    for row in results["results"]:
        low, high = row["ratio_spread"]
        assert low <= row["ratio_median"] <= high
        assert row["raw_ms_per_step"] > 0 and row["nn_handler_ms_per_step"] > 0


def test_checkpoint_io_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("checkpoint_io.py", tmp_path)
    assert results["state_dict_mb"] == 10
    for row in results["results"].values():
        low, high = row["ratio_spread"]
        assert low <= row["ratio_to_torch_median"] <= high and row["mb_per_s"] > 0
    assert set(results["targets"]) == {"atomic_save_within_2x", "load_within_1.2x"}


@pytest.mark.distributed
def test_object_collectives_quick_mode_writes_its_fields(tmp_path: Path) -> None:
    results = run_quick("object_collectives.py", tmp_path)
    assert list(results["objects"]) == [
        "list of 1k floats",
        "dict of 100 small tensors",
        "10 MB numpy array",
        "100 MB bytes",
    ]
    for row in [*results["objects"].values(), *results["variable_tensors"].values()]:
        low, high = row["ratio_spread"]
        assert low <= row["ratio_median"] <= high and row["torch_ms"] > 0
    for rank in results["peak_memory_per_rank"]:
        assert rank["nn_handler_peak_x_payload"] > 0 and rank["torch_peak_x_payload"] > 0
    assert len(results["targets_met"]) == 6
