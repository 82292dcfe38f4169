"""The README's first example runs as written, alone and on 2 ranks under torchrun: it reaches
the accuracy it promises and prints one line per epoch, once, with no progress bar in a pipe;
the speed-ups it quotes are those the committed benchmark results measure."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.harness import run_command, torchrun_command

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _first_example(folder: Path) -> Path:
    section = README.split("## A first look", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = folder / "train.py"
    script.write_text(code)
    return script


def _check_output(output: str, ranks: int) -> None:
    accuracy = re.findall(r"validation accuracy (\d\.\d+)", output)
    assert len(accuracy) == 1, output  # printed by rank 0 only
    assert float(accuracy[0]) >= 0.95, output
    for epoch in range(1, 13):
        lines = [line for line in output.splitlines() if f"epoch {epoch}/12: " in line]
        assert len(lines) == 1, (epoch, lines)  # one line per event, whatever the ranks
        assert lines[0].startswith(re.findall(r"^\d\d:\d\d:\d\d \| rank 0 \| ", lines[0])[0])
    assert "it/s]" not in output and "%|" not in output, "no progress bar in a pipe"
    loaders = [line for line in output.splitlines() if "loaders: mode=" in line]
    assert len(loaders) == 1 and f"effective_batch_size={32 * ranks}" in loaders[0], loaders


def test_readme_first_example_reaches_its_accuracy_alone(tmp_path: Path) -> None:
    script = _first_example(tmp_path)
    code, output = run_command([sys.executable, str(script)], timeout=180, cwd=tmp_path)
    assert code == 0, output
    _check_output(output, ranks=1)
    assert (tmp_path / "curves.png").is_file()


@pytest.mark.distributed
def test_readme_first_example_reaches_its_accuracy_under_torchrun(tmp_path: Path) -> None:
    script = _first_example(tmp_path)
    code, output = run_command(torchrun_command(script), timeout=240, cwd=tmp_path)
    assert code == 0, output
    _check_output(output, ranks=2)
    assert (tmp_path / "curves.png").is_file()


def _parts_example(folder: Path) -> Path:
    section = README.split("The parts underneath can be used on their own:", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = folder / "parts.py"
    # One write per rank's line: two ranks' prints must not interleave inside a line.
    script.write_text(code + 'print(f"{ctx.rank} {tuple(every.shape)} {metrics}", flush=True)\n')
    return script


@pytest.mark.distributed
def test_readme_parts_example_runs_alone_and_under_torchrun(tmp_path: Path) -> None:
    script = _parts_example(tmp_path)
    code, output = run_command([sys.executable, str(script)], timeout=60)
    assert code == 0, output
    assert "0 (3, 10) {'acc': 0.9, 'loss': 0.25}" in output
    code, output = run_command(torchrun_command(script), timeout=120)
    assert code == 0, output
    for rank in (0, 1):  # 3 + 4 rows gathered exactly; the same mean on both ranks
        assert f"{rank} (7, 10) {{'acc': 0.9, 'loss': 0.25}}" in output, output


def _claimed(pattern: str, text: str) -> list[str]:
    found = re.findall(pattern, text)
    assert found, pattern
    return found


def test_quoted_speedups_match_the_committed_benchmark_results() -> None:
    results = ROOT / "benchmarks" / "results"
    objects = json.loads((results / "object_collectives.json").read_text())["objects"]
    measured = objects["dict of 100 small tensors"]["speedup"]
    docs = README + (ROOT / "docs" / "distributed.md").read_text()
    for claim in _claimed(
        r"(\d+)x faster than `dist\.all_gather_object` on a dict|"
        r"dict of 100 small\s+tensors gathers (\d+)x faster",
        docs,
    ):
        value = float(next(part for part in claim if part))
        assert abs(value - measured) / measured < 0.25, (value, measured)
    cache = json.loads((results / "loader_cache.json").read_text())["per_rank"]
    ratios = [
        r["distributed_w0"]["later_epoch_s"] / r["rank_cached"]["later_epoch_s"] for r in cache
    ]
    docs = README + (ROOT / "docs" / "data.md").read_text()
    for low, high in _claimed(r"later epochs (?:measured )?(\d+)-(\d+)x faster", docs):
        assert round(min(ratios)) == int(low) and round(max(ratios)) == int(high), ratios
