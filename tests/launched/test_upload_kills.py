"""The SIGKILL-during-upload campaign (tests/scripts/upload_kill_campaign.py), a few kills of
it: after each, the S3 server's ``latest`` loads and no half-uploaded checkpoint is trusted.
The full campaign (20+ kills) runs from the command line; its result is in the docs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.harness import run_command

SCRIPT = Path(__file__).parents[2] / "tests" / "scripts" / "upload_kill_campaign.py"


def test_kills_during_uploads_always_leave_a_loadable_latest() -> None:
    command = [sys.executable, str(SCRIPT), "--kills", "3", "--seed", "7", "--max-delay", "1.0"]
    code, output = run_command(command, timeout=300)
    assert code == 0, output
    line = next(x for x in reversed(output.splitlines()) if '"latest_loadable"' in x)
    summary = json.loads(line)
    assert summary["kills"] == 3, output
    assert summary["latest_loadable"] == 3 and summary["committed_broken"] == 0, output
    assert summary["committed_checked"] >= 3, output  # the reader checked committed ones
