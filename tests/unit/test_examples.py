"""Every example runs (alone and under torchrun)."""

from __future__ import annotations

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
    final = float(output.split("final: val_accuracy=")[1].split()[0])
    assert final >= 0.9, output


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
