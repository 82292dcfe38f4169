"""Ranks started by hand (no agent to stop the others, as srun without --kill-on-bad-exit):
when one leaves mid-training, its peer raises RankFailedError naming that rank and how it
left, promptly, instead of a raw gloo "Connection closed by peer" after a wait."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.forked import Script, run_scripts
from tests.harness import free_port
from tests.interpreters import python_path

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "leaving_rank.py"
ROOT = SCRIPT.parents[2]

#: mode, leaving rank, what the survivor's message must say about it. (os._exit looks like
#: SIGKILL to the survivor, no Python runs in either: leaving_rank.py has it, the suite runs
#: SIGKILL only, to save two interpreters.)
CASES = [
    ("exit", 1, "SystemExit (exit status 3)"),
    ("sigint", 1, "KeyboardInterrupt"),
    ("sigkill", 1, "gone without a word"),
    ("sigkill", 0, "store no longer answers"),
]


def _scripts(out: Path, mode: str, leaver: int) -> list[Script]:
    """Both ranks, started by hand (forked from the preloaded forkserver: tests/forked.py)."""
    port = free_port()
    return [
        Script(
            SCRIPT,
            (str(out), mode, str(leaver)),
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for rank in (0, 1)
    ]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    base = tmp_path_factory.mktemp("leaving")
    folders = {}
    scripts = []
    for mode, leaver, _ in CASES:
        folder = base / f"{mode}-{leaver}"
        folder.mkdir()
        folders[(mode, leaver)] = folder
        scripts += _scripts(folder, mode, leaver)
    results = run_scripts(scripts, timeout=100, env={"PYTHONPATH": python_path(ROOT)})
    for folder, index in zip(folders.values(), range(0, len(results), 2), strict=True):
        (folder / "output.txt").write_text(
            "\n".join(f"--- exit {code} ---\n{text}" for code, text in results[index : index + 2])
        )
    return folders


@pytest.mark.parametrize(("mode", "leaver", "how"), CASES)
def test_the_survivor_names_the_rank_that_left_and_how(
    outcomes: dict[tuple[str, int], Path], mode: str, leaver: int, how: str
) -> None:
    folder = outcomes[(mode, leaver)]
    output = (folder / "output.txt").read_text()
    survivor = folder / "survivor.json"
    assert survivor.exists(), f"the survivor raised no RankFailedError:\n{output}"
    report = json.loads(survivor.read_text())
    assert report["failed"] == [leaver], report["message"]
    assert how in report["message"], report["message"]
    assert "Connection closed by peer" not in report["message"].splitlines()[0]
    left = json.loads((folder / "left.json").read_text())["time"]
    # Well before the 60 s process-group timeout (a hang until then is the bug).
    assert report["time"] - left < 20, f"{report['time'] - left:.1f} s"
