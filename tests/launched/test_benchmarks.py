"""The benchmarks run end to end in quick mode (one run of ``run_all.py``, as ``make
bench-quick`` does) and write the fields the report reads; the report renders every section.

Never a timed test: speed is judged by the full ``make bench`` and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_command
from tests.timeouts import scaled

ROOT = Path(__file__).parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every benchmark in --quick mode, once for this module; the folder of results."""
    folder = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable,
        str(BENCHMARKS / "run_all.py"),
        "--quick",
        "--jobs",
        "2",
        "--results",
        str(folder),
        "--report",
        str(folder / "RESULTS.md"),
    ]
    code, output = run_command(command, timeout=360)
    assert code == 0, output
    return folder


def run_quick(script: str, folder: Path) -> dict[str, Any]:
    """The JSON results of one benchmark of the quick run, with the shared fields checked."""
    results: dict[str, Any] = json.loads((folder / script.replace(".py", ".json")).read_text())
    assert {"machine", "command", "date", "benchmark"} <= set(results)
    assert results["machine"]["torch"] and results["command"].startswith("python benchmarks/")
    assert results["command"].endswith("--quick")
    assert all(isinstance(ok, bool) for ok in results.get("targets_met", {}).values())
    return results


def test_communicator_overhead_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("communicator_overhead.py", quick_run)
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


def test_loader_cache_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("loader_cache.py", quick_run)
    assert results["world_size"] == 2 and len(results["per_rank"]) == 2
    for timings in results["per_rank"]:
        assert set(timings) == {"distributed_w0", "distributed_w1", "rank_cached"}
        batches = {v["batches_per_epoch"] for v in timings.values()}
        assert batches == {16}, "every variant gives each rank the same number of batches"
    for ratio in results["ratios"]:
        assert ratio["later_epoch_speedup_vs_distributed_w0"] > 0


def test_ema_update_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("ema_update.py", quick_run)
    assert results["tensors"] == 200
    for row in results["results"].values():
        low, high = row["ratio_spread"]
        assert low <= row["ratio_to_bare_median"] <= high and row["ms_per_update"] > 0
    assert set(results["results"]) >= {"foreach_lerp (bare)", "nn_handler ModelEma.update"}


def test_checkpoint_io_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("checkpoint_io.py", quick_run)
    assert results["state_dict_mb"] == 10
    for row in results["results"].values():
        low, high = row["ratio_spread"]
        assert low <= row["ratio_to_torch_median"] <= high and row["mb_per_s"] > 0
    assert len(results["targets_met"]) == 2


def test_async_saves_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("async_saves.py", quick_run)
    assert set(results["results"]) == {"1 process", "2 ranks"}
    for rows in results["results"].values():
        assert list(rows) == [
            "memcpy",
            "async save, local folder: blocked",
            "async save, local folder: its commit at the next wait",
            "synchronous save",
            "fsync'd write",
            "async save, s3://: blocked",
        ]
        assert all(row["seconds_median"] > 0 for row in rows.values())
        for name in ("async save, local folder: blocked", "async save, s3://: blocked"):
            low, high = rows[name]["ratio_spread"]
            assert low <= rows[name]["ratio_median"] <= high
        assert rows["synchronous save"]["bandwidth_share"]["ratio_median"] > 0
    assert results["every_step"]["steps"] == 20  # every step saved, no deadlock
    for key in ("beside",):  # steps while a save wrote in the background
        assert results[key]["steps_during"] > 0 and results[key]["step_ms_alone"] > 0
    assert len(results["targets_met"]) == 7


def test_object_store_checkpoints_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("object_store_checkpoints.py", quick_run)
    assert results["state_dict_mb"] == 10
    assert list(results["results"]) == [
        "torch.save",
        "save_periodic, local folder",
        "save_periodic, s3:// (upload waited for)",
        "save_periodic, s3:// async_save: the loop's stall",
        "save_periodic, s3:// async_save: background upload done",
    ]
    for row in results["results"].values():
        low, high = row["ratio_spread"]
        assert low <= row["ratio_to_torch_median"] <= high and row["mb_per_s"] > 0
    assert len(results["targets_met"]) == 1


def test_object_collectives_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("object_collectives.py", quick_run)
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


def test_scaling_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("scaling.py", quick_run)
    cpu = results["cpu_small_cnn"]
    assert cpu["world_1"]["samples_per_s"] > 0 and cpu["world_2"]["samples_per_s"] > 0
    assert cpu["efficiency"] == pytest.approx(cpu["speedup_2_over_1"] / 2)
    gpu = results["gpu_bf16_vs_fp32"]
    assert "skipped" in gpu or gpu["bf16_speedup"] > 0


def test_fsdp_sharding_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("fsdp_sharding.py", quick_run)
    ddp, fsdp = results["results"]["ddp"], results["results"]["fsdp"]
    assert ddp["parameters"] == fsdp["parameters"] == 4 * (256 * 256 + 256) + 2570
    for key, value in ddp["state"].items():  # each rank holds half the state, or about
        assert 0.45 < fsdp["state"][key] / value < 0.56, key
    assert results["fsdp_over_ddp"]["step_time"] > 0
    checkpoints = fsdp["checkpoints"]
    assert set(checkpoints["seconds"]) == {
        "sharded",
        "file",
        "load_sharded",
        "load_file",
        "epoch",
        "async_epoch",
        "async_return",
        "sharded_unchecked",
        "load_sharded_unverified",
        "verify",
    }
    assert checkpoints["checksums"]["save_with_over_without"] > 0
    assert checkpoints["single_file_mb"] > 0
    assert len(results["targets_met"]) == 2


def test_training_step_measures_every_variant_in_one_and_two_processes(quick_run: Path) -> None:
    results = run_quick("training_step.py", quick_run)
    assert [(r["world_size"], r["case"]) for r in results["results"]] == [
        (1, "tiny_mlp"),
        (1, "small_cnn"),
        (2, "tiny_mlp"),
        (2, "small_cnn"),
    ]
    for row in results["results"]:
        assert set(row["variants"]) == {
            "raw",
            "nn_handler",
            "nn_handler, monitor off",
            "nn_handler, nonfinite='off'",
            "nn_handler + preemption check",
            "fabric",
            "accelerate",
        } | ({"nn_handler, stall watchdog off"} if row["world_size"] == 2 else set())
        summaries = [
            *row["variants"].values(),
            *row["nn_handler_vs_peers"].values(),
            *([row["watchdog_on_vs_off"]] if row["world_size"] == 2 else []),
            row["monitor_on_vs_off"],
        ]
        assert set(row["nn_handler_vs_peers"]) == {"fabric", "accelerate"}
        for summary in summaries:
            low, high = summary["ratio_ci95"]
            spread_low, spread_high = summary["ratio_spread"]
            assert spread_low <= low <= summary["ratio_median"] <= high <= spread_high
        if row["world_size"] == 2:  # the watchdog's costs timed alone
            costs = row["watchdog_costs"]
            # Timed, so present and positive; how fast is the benchmark's targets' business.
            assert costs["region_us_per_step"] > 0 and costs["look_ms"] > 0
            assert costs["region_share_of_raw_step"] > 0
            assert costs["interval_s"] == 2.0  # stall_timeout 5 min / 20, at most 2 s
        monitor = row["monitor_costs"]  # the throughput monitor's work timed alone
        assert monitor["hooks_us_per_step"] > 0 and monitor["epoch_start_us"] > 0
        assert monitor["share_of_raw_step"] > 0
    evidence = results["target_evidence"]
    assert set(evidence) == set(results["targets_met"]) and len(evidence) == 13
    assert sum("throughput monitor" in target for target in evidence) == 4
    for target, ok in results["targets_met"].items():
        facts = evidence[target]
        assert ok == (facts["median"] <= facts["bound"]), target
        assert facts["ci95"][0] <= facts["median"] <= facts["ci95"][1]
        assert facts["unit"] in {"x", "ms"}


def test_realistic_measures_every_workload_with_page_faults(quick_run: Path) -> None:
    results = run_quick("realistic.py", quick_run)
    workloads = [(r["workload"], r["world_size"]) for r in results["results"]]
    assert workloads == [
        ("resnet8", 1),
        ("end of epoch, tiny_mlp", 1),
        ("resnet8", 2),
        ("resnet8, accumulation x4", 2),
        ("transformer", 2),
        ("evaluate tiny_mlp", 2),
        ("evaluate resnet8", 2),
        ("end of epoch, tiny_mlp", 2),
        ("startup and memory, resnet8", 2),
    ]
    for row in results["results"]:
        for variant in row.get("variants", {}).values():
            assert variant["ms_per_step"] > 0 and variant["faults_per_step"] >= 0
            assert {"vs_raw", "vs_fabric"} <= set(variant)
        if "variants" in row:
            assert set(row["variants"]) == {"raw", "nn_handler", "fabric"}
    startup = results["results"][-1]
    assert (
        set(startup["startup_ms"]) == set(startup["peak_rss_mb"]) == {"raw", "nn_handler", "fabric"}
    )
    assert all(mb > 50 for mb in startup["peak_rss_mb"].values())
    evidence = results["target_evidence"]
    assert len(results["targets_met"]) == 12 and set(evidence) <= set(results["targets_met"])
    for target, facts in evidence.items():
        assert results["targets_met"][target] == (facts["median"] <= facts["bound"]), target


def test_the_report_has_a_section_per_benchmark_and_lists_every_target(quick_run: Path) -> None:
    page = (quick_run / "RESULTS.md").read_text()
    assert page.startswith("# Benchmark results")
    assert "CPU cores" in page and "torch 2." in page and "lightning_fabric" in page
    for name in report.ORDER:
        assert f"## {name}" in page
    for name in report.ORDER:
        data = json.loads((quick_run / f"{name}.json").read_text())
        for target in data.get("targets_met", {}):
            assert target in page, target


def test_the_committed_results_page_matches_the_committed_results() -> None:
    results = report.load(BENCHMARKS / "results")
    assert set(results) == set(report.ORDER), "every benchmark has committed full results"
    committed = (BENCHMARKS / "RESULTS.md").read_text()
    assert committed == report.render(results, "make bench", "benchmarks/results"), (
        "benchmarks/RESULTS.md is stale: run `make bench` (or benchmarks/report.py)"
    )
    for data in results.values():
        assert not data["command"].endswith("--quick"), "committed results are full runs"


def test_reproducible_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("reproducible.py", quick_run)
    for case in ("resnet8", "transformer"):
        found = results["results"][case]
        # int64 per parameter against DDP's float32, plus the slots
        assert found["bytes_per_step_reproducible"] > 2 * found["bytes_per_step_ddp"] > 0
        assert found["ratio_median"] > 0 and found["steps_per_epoch"] >= 1
        assert found["fsdp_ratio_median"] > 0 and found["epoch_seconds_reproducible_fsdp"] > 0
        for layout, memory in found["mode_memory_bytes"].items():  # the plan states the mode's
            assert memory["planned"] <= memory["held"] <= 1.1 * memory["planned"], layout
    assert set(results["digits_val_accuracy"]) == {"normal", "reproducible"}


def test_memory_plan_quick_mode_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("memory_plan.py", quick_run)
    for found in results["results"].values():
        assert found["peak_bytes"] > 0 and found["plan_bytes"] > 0
        assert found["plan_over_peak"] == found["plan_bytes"] / found["peak_bytes"]
        assert set(found["items_bytes"]) >= {"parameters", "gradients", "activations"}


def test_a_forked_smoke_script_reports_its_exit_status_and_traceback(tmp_path: Path) -> None:
    """run_all's smoke mode runs each script in a process forked from its preloaded server:
    a failing script's status reaches run_all as the interpreter's would (sys.exit's code, 1
    and the traceback on stderr for an exception), its stdout is discarded.

    In a process of its own, as run_all runs: a forkserver already running in this worker
    (the harness's) would write to the streams it started with, not to this test's."""
    (tmp_path / "exits.py").write_text("import sys\nprint('to devnull')\nsys.exit(3)\n")
    (tmp_path / "raises.py").write_text("raise ValueError('a broken benchmark')\n")
    (tmp_path / "passes.py").write_text("import json\n")
    probe = (
        "import os, sys\n"
        "import run_all\n"
        "run_all.PRELOAD[:] = []  # what is preloaded is not the point here\n"
        "env = {**os.environ, 'OMP_NUM_THREADS': '1'}\n"
        "print([run_all._wait(run_all._start([sys.executable, script], env, forked=True))\n"
        "       for script in sys.argv[1:]])\n"
    )
    scripts = [str(tmp_path / name) for name in ("exits.py", "raises.py", "passes.py")]
    done = subprocess.run(
        [sys.executable, "-c", probe, *scripts],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[3, 1, 0]\n", done.stdout  # and nothing from the scripts' stdout
    assert "ValueError: a broken benchmark" in done.stderr, done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr


def test_fault_tolerance_launches_the_job_both_ways_and_writes_its_fields(quick_run: Path) -> None:
    results = run_quick("fault_tolerance.py", quick_run)
    assert results["steps"] == 20 and results["workers"] == 2
    for mode in ("fault_tolerant", "torchrun_restart"):
        measured = results["results"]["no kill"][mode]
        assert measured["kills"] == 0 and measured["wall_s"] > 0
        assert measured["steps_per_minute"] == pytest.approx(20 * 60 / measured["wall_s"])
    assert len(results["targets_met"]) == 1


def test_gpu_step_measures_every_variant_and_skips_without_cuda(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gpu_step.py runs by hand where a GPU is lent: here its timing loops on the
    CPU (one workload, one step an epoch), and its main, which says it measured nothing."""
    import gpu_step

    row = gpu_step._timed("transformer", "32", steps=1, repeats=1, device="cpu")
    assert set(row) == {"batch", "steps_per_epoch", *gpu_step.VARIANTS}
    assert all(row[name]["ms_per_step"] > 0 for name in gpu_step.VARIANTS)
    for name, baseline in gpu_step.BASELINES.items():
        assert row[name]["against"] == baseline and row[name]["ratio_median"] > 0
    assert all("ratio_median" not in row[name] for name in ("normal", "normal_4_micro"))
    raw = gpu_step._against_raw("transformer", "32", 1, 1, "cpu", compiled=False)
    assert raw["nn_handler"]["against"] == "raw" and raw["nn_handler"]["ratio_median"] > 0
    assert raw["nn_handler_plain_sgd"]["against"] == "raw_plain_sgd"
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["gpu_step.py", "--quick"])
        gpu_step.main()
        assert "no CUDA device on this machine; nothing measured" in capsys.readouterr().out


def test_ft_agreement_times_each_job_alone_and_plots_the_overhead(tmp_path: Path) -> None:
    """benchmarks/ft_agreement.py runs by hand (16 member processes, about 15 minutes): here
    both jobs alone for a few steps (the baselines its members are measured against: each
    writes one time per optimizer step), and its plot of the overhead against members."""
    import ft_agreement

    for kind in ft_agreement.KINDS:
        times = ft_agreement.step_times(kind, 0, 6, tmp_path / kind)
        assert len(times) == 4 and all(t >= 0.3 for t in times), (kind, times)  # 0.3-s steps
    rows = [
        {"members": n, "nn_handler": {"overhead_ms": 2.0 * n}, "torchft": {"overhead_ms": 3.0 * n}}
        for n in (2, 4)
    ]
    svg = ft_agreement.overhead_svg(rows)
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    assert ">nn_handler</text>" in svg and ">torchft</text>" in svg


def test_ft_goodput_checks_every_step_s_bits_and_samples_and_plots_beside_torchft() -> None:
    """benchmarks/ft_goodput.py runs by hand (about 15 minutes; `--quick` in a minute): its
    oracles must be able to fail: a member holding other bits after any step both runs ran,
    two SHA-256s after one step, a step that loaded other samples, an epoch of the
    failure-free run that misses a sample; its plot has torchft's published points."""
    import ft_goodput

    reference = {
        "sha256": {"1": ["a"], "2": ["b"], "3": ["c"]},
        "ledger": {str(s): list(range(96 * s, 96 * s + 96)) for s in range(20)},
    }
    held = {"sha256": {"1": ["a"], "2": ["b"]}, "ledger": {"0": list(range(96))}}
    assert ft_goodput.bits_hold(held, reference)
    assert not ft_goodput.bits_hold({"sha256": {"1": ["a"], "2": ["x"]}}, reference)
    assert not ft_goodput.bits_hold({"sha256": {"1": ["a", "x"]}}, reference)
    assert ft_goodput.ledger_holds(held, reference)
    assert not ft_goodput.ledger_holds({"ledger": {"0": list(range(1, 97))}}, reference)
    short = {**reference, "ledger": {**reference["ledger"], "19": list(range(1824, 1919))}}
    assert not ft_goodput.ledger_holds(held, short)
    rows = [
        {"steps_per_failure": every, "efficiency": share}
        for every, share in ((50.0, 0.97), (20.0, 0.93), (5.5, 0.8), (1.4, 0.5))
    ]
    svg = ft_goodput.efficiency_svg(rows)
    assert svg.startswith("<svg") and svg.count("<circle") == 2
    assert "nn_handler (measured)" in svg and "torchft (published)" in svg
