"""SIGKILL a training job at random moments while it uploads checkpoints to S3, and check after
every kill that the store's ``latest`` loads and that no half-uploaded checkpoint is trusted.

Usage: python tests/scripts/upload_kill_campaign.py [--kills 20] [--seed 0] [--max-delay 2.5]

Starts moto's S3 server on 127.0.0.1 (tests/object_store.py), runs one job to completion (so a
committed ``latest`` exists), then ``--kills`` times: starts the job again on a fresh machine
(an empty working copy; it resumes from the store, cleaning what the previous kill left),
waits until it trains, SIGKILLs it after a random delay (a checkpoint is written and uploaded
after every optimizer step, every other job in the background), and checks the store with a
reader of its own: the checkpoint ``latest.json`` names downloads, matches its manifest and
loads; so does every other committed checkpoint. Prints one JSON line; exits 1 when any kill
left ``latest`` unloadable or a committed checkpoint broken.

The job (``--child URL STAGING ASYNC``) trains a 12 MB model for many epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2]))


def child(url: str, staging: str, background: bool, ready: str) -> None:
    import torch
    from torch import nn

    from nn_handler import HandlerConfig, Hook, NNHandler
    from tests.training_helpers import regression_data

    class Ready(Hook):
        def after_step(self) -> None:
            Path(ready).touch()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Linear(1024, 3))
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "seed": 1},
            "trainer": {"progress_bar": False},
            "logging": {"level": "WARNING"},
            "checkpoint": {
                "dir": url,
                "staging_dir": staging,
                "every_n_steps": 1,
                "keep_last": 2,
                "save_best": True,
                "resume": "auto",
                "async_save": background,
            },
        }
    )
    with NNHandler(
        model, lambda p: torch.optim.Adam(p, lr=1e-3), nn.CrossEntropyLoss(), config=config,
        hooks=[Ready()],
    ) as handler:  # fmt: skip
        handler.train(regression_data(n=32), regression_data(n=8, seed=1), epochs=1000)


def check(url: str, scratch: Path) -> dict[str, Any]:
    """What a reader on a fresh machine finds on the store."""
    import fsspec

    from nn_handler.checkpoint.manifest import SUFFIX
    from nn_handler.checkpoint.opening import open_checkpoint
    from nn_handler.errors import CheckpointError

    outcome: dict[str, Any] = {"latest": None, "committed": 0, "broken": []}
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    try:  # the newest committed one is the one latest.json names (no fallback needed)
        opened = open_checkpoint(url, staging_dir=str(scratch / "latest"))
        pointed = json.loads(fs.cat(f"{root}/latest.json"))["checkpoint"]
        if opened.path.name == pointed:
            outcome["latest"] = pointed
        else:
            outcome["latest_error"] = f"opened {opened.path.name}; latest.json names {pointed}"
    except CheckpointError as error:
        outcome["latest_error"] = str(error)
    names = [Path(key).name[: -len(SUFFIX)] for key in fs.ls(root) if key.endswith(SUFFIX)]
    for name in names:
        try:
            open_checkpoint(f"{url}/{name}", staging_dir=str(scratch / "all"))
            outcome["committed"] += 1
        except CheckpointError as error:
            if "not committed" in str(error):  # deleted (rotated) since the listing
                continue
            outcome["broken"].append(f"{name}: {error}")
    outcome["incomplete"] = sum(
        1 for key in fs.ls(root) if not key.endswith((SUFFIX, "latest.json"))
    ) - len(names)
    return outcome


def campaign(kills: int, seed: int, max_delay: float) -> int:
    from tests.object_store import serving

    rng = random.Random(seed)
    script = str(Path(__file__).resolve())
    with serving() as server, tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        os.environ.update(server.env())
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("campaign")
        url = "s3://campaign/run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}

        def start(i: int, background: bool) -> tuple[subprocess.Popen[bytes], Path]:
            ready = work / f"ready-{i}"
            command = [sys.executable, script, "--child", url, str(work / f"machine-{i}"),
                       str(int(background)), str(ready)]  # fmt: skip
            return subprocess.Popen(command, env=env, stderr=subprocess.PIPE), ready

        first, ready = start(-1, False)
        deadline = time.monotonic() + 120
        while not ready.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a few committed checkpoints
        first.send_signal(signal.SIGTERM)  # a clean stop: the campaign starts from a latest
        first.wait(60)
        results = []
        for i in range(kills):
            background = i % 2 == 1
            job, ready = start(i, background)
            deadline = time.monotonic() + 120
            while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if job.poll() is not None:
                print(job.stderr.read().decode() if job.stderr else "", file=sys.stderr)
                raise SystemExit(f"job {i} ended before it was killed (status {job.returncode})")
            delay = rng.uniform(0.0, max_delay)
            time.sleep(delay)
            job.kill()
            job.wait(30)
            seen = check(url, work / f"check-{i}")
            seen.update(kill=i, delay_s=round(delay, 3), background=background)
            results.append(seen)
            print(json.dumps(seen), file=sys.stderr)
    loadable = sum(1 for r in results if r["latest"] is not None)
    broken = sum(len(r["broken"]) for r in results)
    summary = {
        "kills": len(results),
        "latest_loadable": loadable,
        "committed_checked": sum(r["committed"] for r in results),
        "committed_broken": broken,
        "incomplete_left_by_kills": sum(1 for r in results if r["incomplete"] > 0),
    }
    print(json.dumps(summary))
    return 0 if loadable == len(results) and broken == 0 else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5])
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=2.5)
    args = parser.parse_args()
    return campaign(args.kills, args.seed, args.max_delay)


if __name__ == "__main__":
    raise SystemExit(main())
