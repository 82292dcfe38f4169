"""The nn-handler console script."""

from __future__ import annotations

import re
import sys

import pytest

from nn_handler.cli import build_parser, main
from tests.harness import run_command


def test_help_lists_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "demo" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["demo", "--nproc", "0"], ["demo", "--nproc", "x"], ["fly"]])
def test_bad_arguments_exit_non_zero_with_one_line(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(bad)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("nn-handler")


@pytest.mark.distributed
def test_demo_runs_two_processes_under_torchrun() -> None:
    code, output = run_command(
        [sys.executable, "-m", "nn_handler.cli", "demo", "--nproc", "2"], timeout=120
    )
    assert code == 0, output
    assert "nn_handler demo: 2 processes, backend gloo" in output
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank} on cpu: DistributedInfo\(local_rank={rank}, rank={rank}", output
        )
    assert "launcher='torchrun'" in output
    assert "[[0], [1, 1]]" in output and "all_reduce (sum of ranks): 1" in output
