"""The nn-handler console script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nn_handler.cli import build_parser, demo_placement, main, run_env
from tests.harness import run_command


def test_help_lists_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "demo" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [
        ["demo", "--nproc", "0"],
        ["demo", "--nproc", "x"],
        ["demo", "--epochs", "0"],
        ["demo", "--precision", "fp8"],
        ["env", "--what"],
        ["fly"],
    ],
)
def test_bad_arguments_exit_non_zero_with_one_line(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(bad)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("nn-handler")


def test_env_reports_a_single_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_env({}) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "backends: gloo yes" in out
    assert "launcher: single" in out


def test_env_reports_torchrun_variables(capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    assert run_env(env) == 0
    out = capsys.readouterr().out
    assert "launcher: torchrun" in out and "rank=1" in out and "world_size=2" in out


def test_env_flags_inconsistent_variables(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_env({"RANK": "3", "WORLD_SIZE": "2"}) == 1
    assert "INCONSISTENT" in capsys.readouterr().out


def test_env_command_runs() -> None:
    code, output = run_command([sys.executable, "-m", "nn_handler.cli", "env"], timeout=60)
    assert code == 0, output
    assert "launcher:" in output


@pytest.mark.parametrize("command", ["demo", "env"])
def test_each_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0 and "usage: nn-handler " + command in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs where there is CUDA")
def test_demo_fp16_on_the_cpu_is_one_line_and_exit_2(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "nn_handler.cli", "demo", "--precision", "fp16"]
    code, output = run_command([*command, "--out", str(tmp_path)], timeout=60)
    assert code == 2, output
    assert output.strip().splitlines() == [
        "nn-handler demo: error: --precision fp16 needs CUDA (float16 autocast with a "
        "GradScaler) and this run is on the CPU; use --precision bf16 (or amp, which picks "
        "bf16 on the CPU)"
    ]
    assert not any(tmp_path.iterdir()), "nothing was started"


def test_demo_resume_without_a_run_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["demo", "--resume"])
    assert "--resume found no runs/demo-* folder; pass --out" in str(info.value.code)


@pytest.mark.parametrize(
    ("nproc", "gpus", "backend", "expected"),
    [
        (2, 0, "auto", ("gloo", "cpu")),  # a CPU machine
        (2, 2, "auto", ("auto", "auto")),  # one GPU per process: nccl chosen by the context
        (2, 1, "auto", ("gloo", "cpu")),  # too few GPUs: CPU processes, with a note
        (1, 1, "nccl", ("nccl", "auto")),
        (2, 1, "gloo", ("gloo", "cpu")),
        (2, 2, "gloo", ("gloo", "auto")),  # gloo on the GPUs, as asked
    ],
)
def test_demo_places_processes_on_gpus_only_when_there_are_enough(
    nproc: int, gpus: int, backend: str, expected: tuple[str, str]
) -> None:
    placed_backend, device, note = demo_placement(nproc, gpus, backend)
    assert (placed_backend, device) == expected
    assert (note is not None) == (device == "cpu" and gpus > 0)


def test_checkpoint_inspect_lists_the_position_parts_and_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch import nn

    from nn_handler import NNHandler
    from tests.training_helpers import mlp, regression_data, sgd

    config = {"loader": {"batch_size": 8}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        handler.train(regression_data(), epochs=1)
        path = handler.trainer.save_checkpoint(tmp_path / "run.pt")
    assert main(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "written by 1 rank(s); epochs done 1, optimizer steps 5" in out
    assert "  model: 4 tensor(s), 652 B" in out  # 6x16 + 16 + 16x3 + 3 float32
    assert "  optimizer: 4 tensor(s), 652 B" in out  # SGD's momentum buffers
    assert "  history: no tensors" in out and "  optimizers: empty" in out
    assert "per-rank parts (1 rank(s)): epoch_rng, rng" in out
    torch.save(mlp().state_dict(), tmp_path / "weights.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "weights.pt")]) == 0
    assert (
        "not an nn_handler training checkpoint (OrderedDict): 4 tensor(s), 652 B"
        in capsys.readouterr().out
    )


def test_checkpoint_inspect_of_a_broken_file_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert main(["checkpoint", "inspect", str(tmp_path / "bad.pt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("nn-handler checkpoint inspect: ") and "bad.pt" in err
    assert len(err.splitlines()) == 1
