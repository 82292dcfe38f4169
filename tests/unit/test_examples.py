"""Every example runs (alone and under torchrun)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.harness import free_port, run_command

EXAMPLE = Path(__file__).parents[2] / "examples" / "collectives.py"


def test_collectives_example_runs_alone() -> None:
    code, output = run_command([sys.executable, str(EXAMPLE)], timeout=60)
    assert code == 0, output
    assert "world size 1: gathered (3, 4)" in output


@pytest.mark.distributed
def test_collectives_example_runs_under_torchrun() -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(EXAMPLE),
    ]
    code, output = run_command(command, timeout=120)
    assert code == 0, output
    assert "world size 2: gathered (7, 4)" in output and "'rows': 3.5" in output
