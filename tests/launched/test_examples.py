"""Every example runs (alone and under torchrun)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.harness import run_command, torchrun_command

EXAMPLE = Path(__file__).parents[2] / "examples" / "collectives.py"


def test_collectives_example_runs_alone() -> None:
    code, output = run_command([sys.executable, str(EXAMPLE)], timeout=60)
    assert code == 0, output
    assert "world size 1: gathered (3, 4)" in output


@pytest.mark.distributed
def test_collectives_example_runs_under_torchrun() -> None:
    code, output = run_command(torchrun_command(EXAMPLE), timeout=120)
    assert code == 0, output
    assert "world size 2: gathered (7, 4)" in output and "'rows': 3.5" in output


EXAMPLES = EXAMPLE.parent


def test_parallel_devices_example_runs_as_seed_002_documents() -> None:
    code, output = run_command([sys.executable, str(EXAMPLES / "parallel_devices.py")], timeout=120)
    assert code == 0, output
    assert "my_model_forward: output of shape (128, 1)" in output
    assert "[[2, 4, 6], [2, 4, 6]]" in output


@pytest.mark.distributed
def test_launch_training_example_trains_a_small_model_on_two_processes() -> None:
    command = [sys.executable, str(EXAMPLES / "launch_training.py"), "--epochs", "30"]
    code, output = run_command(command, timeout=180)
    assert code == 0, output
    accuracy = float(output.split("'accuracy': ")[1].split("}")[0])
    assert accuracy > 0.9, output


@pytest.mark.distributed
def test_rank_decorators_example_alone_and_under_torchrun() -> None:
    script = str(EXAMPLES / "rank_decorators.py")
    code, output = run_command([sys.executable, script], timeout=60)
    assert code == 0 and "caught the original error: OSError('disk full')" in output, output
    code, output = run_command(torchrun_command(script), timeout=120)
    assert code == 0, output
    assert "rank 1: save_checkpoint returned None" in output
    assert "rank 1 caught: @on_rank(0) flaky failed on rank(s) [0]" in output


def test_custom_trainer_example_trains_with_its_subclass_and_hook() -> None:
    pytest.importorskip("sklearn")
    code, output = run_command([sys.executable, str(EXAMPLES / "custom_trainer.py")], timeout=120)
    assert code == 0, output
    assert "epoch 6: val_accuracy=" in output and "reconstruction=" in output
    assert "val_f1=" in output and "train_classification=" in output  # torchmetrics, extras
    final = float(output.split("final: val_accuracy=")[1].split()[0])
    assert final >= 0.9, output


def test_lr_finder_and_validation_sets_example_finds_a_rate_and_reaches_its_accuracy(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    plot = tmp_path / "lr.png"
    script = [
        sys.executable,
        str(EXAMPLES / "lr_finder_and_validation_sets.py"),
        "--plot",
        str(plot),
    ]
    code, output = run_command(script, timeout=180)
    assert code == 0, output
    assert "lr_find: 80 rates tried, suggested lr=" in output and plot.stat().st_size > 0
    assert "val_accuracy/noisy=" in output and "val_loss/clean=" in output  # both sets, named
    final = float(output.split("final: val_accuracy/clean=")[1].split()[0])
    assert final >= 0.9, output


@pytest.mark.distributed
def test_custom_trainer_example_under_torchrun() -> None:
    pytest.importorskip("sklearn")
    code, output = run_command(torchrun_command(EXAMPLES / "custom_trainer.py"), timeout=180)
    assert code == 0, output
    lines = [line for line in output.splitlines() if line.startswith("epoch 6: ")]
    assert len(lines) == 1 and "val_f1=" in lines[0], output  # printed once, by rank 0
    assert float(output.split("final: val_accuracy=")[1].split()[0]) >= 0.9, output


@pytest.mark.distributed
def test_fsdp_transformer_example_under_torchrun_shards_and_learns() -> None:
    code, output = run_command(torchrun_command(EXAMPLES / "fsdp_transformer.py"), timeout=180)
    assert code == 0, output
    finals = [line for line in output.splitlines() if line.startswith("final: ")]
    assert len(finals) == 1 and "(FSDP2Strategy)" in finals[0], output
    assert float(finals[0].split("val_accuracy=")[1].split()[0]) >= 0.95, output


def test_preemptible_training_example_continues_in_a_second_run(tmp_path: Path) -> None:
    script = [sys.executable, str(EXAMPLES / "preemptible_training.py"), "--dir", str(tmp_path)]
    code, output = run_command([*script, "--epochs", "1"], timeout=120)
    assert code == 0, output
    assert "epochs done: 1;" in output
    first_accuracy = output.split("val accuracy by epoch: ")[1].split()[0].rstrip(",")
    code, output = run_command([*script, "--epochs", "2"], timeout=120)
    assert code == 0, output
    # The second run resumed: its History holds epoch 1 from the first run, unchanged.
    assert "epochs done: 2;" in output
    assert output.split("val accuracy by epoch: ")[1].startswith(first_accuracy)
    assert (tmp_path / "best.pt").is_file() and (tmp_path / "latest.json").is_file()


def _accuracy_line(output: str) -> str:
    found = re.search(r"Validation metrics \(\d process\(es\)\): (\{.*\})", output)
    assert found is not None, output
    return found.group(1)


@pytest.mark.distributed
def test_seed_000_dist_utils_example_gives_the_same_metrics_alone_and_on_two_ranks() -> None:
    script = str(EXAMPLES / "dist_utils_validation.py")
    code, alone = run_command([sys.executable, script], timeout=60)
    assert code == 0, alone
    code, two = run_command(torchrun_command(script), timeout=120)
    assert code == 0, two
    assert "'samples': 359.0" in _accuracy_line(alone)
    assert _accuracy_line(alone) == _accuracy_line(two)  # every sample once, gathered exactly
    assert "rank 0 done" in two and "rank 1 done" in two and "GPU memory" in two


@pytest.mark.distributed
def test_seed_001_dd_helpers_example_broadcasts_and_aggregates() -> None:
    code, output = run_command(torchrun_command(EXAMPLES / "dd_helpers_metrics.py"), timeout=120)
    assert code == 0, output
    assert "rank 1: config {'lr': 0.001, 'epochs': 3}" in output
    assert "aggregated over 2 rank(s): {'accuracy': 0.825, 'f1': 0.75}, loss 1.5000" in output


@pytest.mark.distributed
def test_seed_004_helios_example_under_torchrun() -> None:
    code, output = run_command(torchrun_command(EXAMPLES / "helios_functions.py"), timeout=120)
    assert code == 0, output
    assert "launcher='torchrun'" in output and "sum of rank+1 over 2 ranks: 3" in output
    assert "gathered into one tensor: [[0.0, 0.0], [1.0, 1.0]]" in output


def test_seed_003_example_script_trains_in_one_process() -> None:
    script = [sys.executable, str(EXAMPLES / "distributed_training_example.py")]
    code, output = run_command([*script, "--use-ema"], timeout=120)
    assert code == 0, output
    found = re.search(r"trained 10 epochs on 1 process\(es\): .* val_loss ([\d.]+)", output)
    assert found is not None and float(found.group(1)) < 0.3, output


@pytest.mark.distributed
def test_seed_003_example_script_with_ema_reaches_its_validation_loss_on_two_ranks() -> None:
    """As seed 003 runs it (--distributed --use-amp --use-ema): the EMA warms up, so the
    validation loss is the trained model's, not the initial weights' (1.14 before)."""
    script = [sys.executable, str(EXAMPLES / "distributed_training_example.py")]
    flags = ["--distributed", "--world-size", "2", "--use-amp", "--use-ema"]
    code, output = run_command([*script, *flags], timeout=180)
    assert code == 0, output
    found = re.search(r"trained 10 epochs on 2 process\(es\): .* val_loss ([\d.]+)", output)
    assert found is not None and float(found.group(1)) < 0.3, output


@pytest.mark.distributed
def test_seed_003_example_script_trains_distributed_with_amp() -> None:
    script = [sys.executable, str(EXAMPLES / "distributed_training_example.py")]
    flags = ["--distributed", "--world-size", "2", "--epochs", "8", "--use-amp"]
    code, output = run_command([*script, *flags], timeout=180)
    assert code == 0, output
    found = re.search(r"trained 8 epochs on 2 process\(es\): .* val_loss ([\d.]+)", output)
    assert found is not None and float(found.group(1)) < 0.5, output


def _gan_line(output: str) -> re.Match[str]:
    found = re.search(
        r"(\d+) steps on (\d) process\(es\): d_loss ([\d.]+), g_loss ([\d.]+), "
        r"generated radius ([\d.]+)",
        output,
    )
    assert found is not None, output
    return found


def test_gan_manual_optimization_example_reaches_the_circle() -> None:
    script = [sys.executable, str(EXAMPLES / "gan_manual_optimization.py")]
    code, output = run_command(script, timeout=120)
    assert code == 0, output
    found = _gan_line(output)
    assert found.group(1) == "480" and abs(float(found.group(5)) - 1.0) < 0.25, output


@pytest.mark.distributed
def test_gan_manual_optimization_example_under_torchrun() -> None:
    code, output = run_command(
        torchrun_command(EXAMPLES / "gan_manual_optimization.py"), timeout=120
    )
    assert code == 0, output
    found = _gan_line(output)
    assert found.group(1) == "240" and found.group(2) == "2", output
    assert abs(float(found.group(3)) - 1.386) < 0.5, "the discriminator is near chance"
    # Each step leaves the part it does not train unused: DDP has nothing to warn about.
    assert "Warning" not in output and "find_unused_parameters" not in output, output


def test_slurm_script_starts_an_existing_example_with_its_options() -> None:
    sbatch = (EXAMPLES / "slurm_job.sbatch").read_text()
    started = re.search(r"srun python (\S+) --dir \S+ --epochs \d+", sbatch)
    assert started is not None
    assert (EXAMPLES.parent / started.group(1)).is_file()
    assert "--signal=TERM@" in sbatch and '"$status" -eq 75' in sbatch


def test_observability_example_reports_a_slow_loader_and_writes_its_files(
    tmp_path: Path,
) -> None:
    script = EXAMPLES / "observability.py"
    command = [sys.executable, str(script), "--dir", str(tmp_path), "--epochs", "1"]
    code, output = run_command([*command, "--slow-data", "0.002"], timeout=180)
    assert code == 0, output
    assert "verdict: data-bound: " in output and "waiting for batches" in output, output
    assert re.search(r"epoch 1/1: .*data_wait=\d+%.*; data-bound: ", output), output
    assert "top operators:" in output and "aten::" in output
    rows = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and "step_ms" in rows[0] and len(rows) == 2
    assert (tmp_path / "mlflow.db").is_file()
    assert list((tmp_path / "profile").glob("rank0.step*.trace.json"))


@pytest.mark.distributed
def test_observability_example_under_torchrun_times_the_exposed_reduction(
    tmp_path: Path,
) -> None:
    command = torchrun_command(EXAMPLES / "observability.py", "--dir", str(tmp_path))
    code, output = run_command(command, timeout=180)
    assert code == 0, output
    assert re.search(r"epoch 2/2: .*samples_per_sec_rank=.*exposed_comm=\d+%", output), output
    accuracy = float(output.split("val_accuracy=")[-1].split()[0])
    assert accuracy > 0.85, output
    traces = sorted(p.name for p in (tmp_path / "profile").glob("*.trace.json"))
    assert [name.split(".")[0] for name in traces] == ["rank0", "rank1"]


def test_every_example_has_a_smoke_test() -> None:
    tests = Path(__file__).read_text()
    for other in ("test_torchrun_multinode.py", "test_ray_train.py"):
        tests += (Path(__file__).parents[1] / "distributed" / other).read_text()
    untested = [p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sbatch")]
    untested = [name for name in untested if f'"{name}"' not in tests]
    assert not untested, f"examples without a smoke test: {untested}"


@pytest.mark.distributed
def test_reproducible_example_prints_the_same_hash_alone_and_on_three_ranks() -> None:
    """docs/reproducible.md's promise, as a user runs it: one process and torchrun with 3
    ranks (which do not divide the step's 4 micro-batches) end with the same SHA-256, at the
    accuracy the page states."""
    pytest.importorskip("sklearn")
    script = str(EXAMPLES / "reproducible_training.py")
    found = []
    for command in ([sys.executable, script], torchrun_command(script, nproc=3)):
        code, output = run_command(command, timeout=180)
        assert code == 0, output
        line = re.search(r"world size (\d): val_accuracy=([\d.]+) sha256=(\w+)", output)
        assert line is not None, output
        found.append(line.groups())
    (w1, accuracy, digest), (w3, accuracy3, digest3) = found
    assert (w1, w3) == ("1", "3") and digest == digest3 and accuracy == accuracy3
    assert float(accuracy) > 0.97, found
    # docs/fault-tolerance.md's one-command demo: three members, one killed in a random step;
    # the two left finish with the same SHA-256, no process restarted.
    if importlib.util.find_spec("torchft") is None:
        return
    code, output = run_command([sys.executable, script, "--fault-tolerant"], timeout=180)
    assert code == 0, output
    members = re.findall(r"member (m\d): val_accuracy=([\d.]+) sha256=(\w+)", output)
    assert sorted(members) == [("m0", accuracy, digest), ("m2", accuracy, digest)], output
    assert re.search(r"m1 was killed in step \d+ \(exit -9\); m0 and m2 exited 0, 0", output)


@pytest.mark.distributed
def test_large_model_example_trains_a_model_over_the_budget_within_its_plan() -> None:
    code, output = run_command(torchrun_command(EXAMPLES / "large_model.py"), timeout=240)
    assert code == 0, output
    finals = [line for line in output.splitlines() if line.startswith("final: ")]
    assert len(finals) == 1, output
    numbers = re.findall(r"[\d.]+", finals[0].split("val_accuracy=")[1])
    accuracy, whole, plan, budget = (float(n.rstrip(".")) for n in numbers[:4])
    assert accuracy >= 0.95, output
    assert whole > budget >= plan, output  # the whole model does not fit; each rank's shard does
    for item in ("parameters", "gradients", "optimizer state", "activations", "total"):
        assert sum(f"|   {item}: " in line for line in output.splitlines()) == 1, output
