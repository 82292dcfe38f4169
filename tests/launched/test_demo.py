"""The demo as a user runs it: two processes under torchrun, then a resume."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.harness import run_command


@pytest.mark.distributed
def test_demo_trains_digits_on_two_processes_and_resumes(tmp_path: Path) -> None:
    demo = [sys.executable, "-m", "nn_handler.cli", "demo", "--out", str(tmp_path)]
    code, output = run_command([*demo, "--epochs", "10"], timeout=120)
    assert code == 0, output
    found = re.search(r"2 processes on cpu, 10 epochs, final validation accuracy ([\d.]+)%", output)
    assert found is not None, output
    assert float(found.group(1)) >= 95.0
    for name in ("curves.png", "history.json", "history.csv", "checkpoints/latest.json"):
        assert (tmp_path / name).is_file(), name
    assert "epoch 10/10:" in output  # the per-epoch summary lines
    # The throughput and the step anatomy of the last epoch (2 ranks: the reduction timed).
    assert re.search(r"throughput: \d+ samples/s \(\d+ on rank 0\), [\d.]+ GFLOP/s", output)
    anatomy = re.search(
        r"step anatomy \(last epoch, rank 0\): [\d.]+ ms per step: waiting for data (\d+)%, "
        r"compute (\d+)%, exposed gradient reduction (\d+)%, checkpoints (\d+)%; "
        r"peak memory \d+ MB",
        output,
    )
    assert anatomy is not None, output
    assert 50 <= sum(int(share) for share in anatomy.groups()) <= 101, output
    assert re.search(r"  verdict: (no part dominates the step|\w+-bound: \d+% )", output)
    code, output = run_command([*demo, "--epochs", "12", "--resume"], timeout=120)
    assert code == 0, output
    assert "resumed from" in output and "12 epochs" in output
    assert "epoch 1/12:" not in output  # it continued; it did not start again
