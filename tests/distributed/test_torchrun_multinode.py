"""Real torchrun: a 2-node x 2-process job on 127.0.0.1, and root causes in torchrun's report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.harness import free_port, run_command, run_commands, torchrun_command

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parents[2]


def test_two_torchrun_agents_form_one_four_process_job(tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=nn-handler-test-{port}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        str(ROOT / "examples" / "multinode_torchrun.py"),
        str(tmp_path),
    ]
    outcomes = run_commands([command, command], timeout=150)  # two agents, two "machines"
    assert [code for code, _ in outcomes] == [0, 0], "\n".join(out for _, out in outcomes)
    lines = {int(p.stem[4:]): p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert sorted(lines) == [0, 1, 2, 3]
    for rank, line in lines.items():
        node, local = divmod(rank, 2)
        machine = [node * 2, node * 2 + 1]
        assert line == (
            f"rank={rank} local_rank={local} node_rank={node} world_size=4 local_world_size=2 "
            f"machine_ranks={machine} sum_of_ranks=6 launcher=torchrun"
        )


def test_torchrun_names_the_real_root_cause_of_a_failing_rank() -> None:
    script = ROOT / "tests" / "scripts" / "torchrun_failing.py"
    code, output = run_command(torchrun_command(script), timeout=120)
    assert code != 0
    root_cause = output.split("Root Cause (first observed failure):")[-1]
    assert "rank      : 1" in root_cause, output
    assert "ValueError: deliberate failure on rank 1" in root_cause, output
