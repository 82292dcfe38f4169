"""The cluster recipes' script (examples/preemptible_training.py, run by
examples/cluster/trainjob.yaml and skypilot.yaml) with its checkpoints on S3 (moto on
127.0.0.1): a second start on a fresh machine (another cache folder, nothing local) resumes
from the bucket and trains on to the accuracy the example promises."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.harness import run_command
from tests.object_store import Bucket, s3, s3_server

__all__ = ["s3", "s3_server"]  # fixtures

SCRIPT = Path(__file__).parents[2] / "examples" / "preemptible_training.py"


def test_the_recipe_script_resumes_from_s3_on_a_fresh_machine(s3: Bucket, tmp_path: Path) -> None:
    url = f"{s3.url}/runs/digits"
    first = {"XDG_CACHE_HOME": str(tmp_path / "machine-1")}
    code, output = run_command(
        [sys.executable, str(SCRIPT), "--dir", url, "--epochs", "2"], timeout=240, env=first
    )
    assert code == 0, output
    assert "epochs done: 2" in output, output
    fresh = {"XDG_CACHE_HOME": str(tmp_path / "machine-2")}
    code, output = run_command(
        [sys.executable, str(SCRIPT), "--dir", url, "--epochs", "4"], timeout=240, env=fresh
    )
    assert code == 0, output
    resumed = re.search(r"resume='auto': resumed from (\S+)", output)
    assert resumed is not None, output
    assert resumed.group(1).startswith(f"{url}/ckpt-e0002-"), output  # the store's name
    assert "epochs done: 4" in output, output
    accuracies = [float(a) for a in re.findall(r"\d\.\d{3}", output.split("by epoch:")[1])]
    assert len(accuracies) == 4 and accuracies[-1] >= 0.9, output
    working_copy = tmp_path / "machine-2" / "nn_handler" / "checkpoints"
    assert any(working_copy.rglob("ckpt-e0004-*.pt")), output  # its own, uploaded too
