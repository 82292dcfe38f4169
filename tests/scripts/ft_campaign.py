"""A kill campaign against per-step fault tolerance (tests/scripts/ft_member.py's members of
tests/ft_helpers.py's exact problem, a Lighthouse process): seeded kills at random moments,
SIGKILL (a death) or SIGSTOP (a hang, killed once it is left out), each member replaced by a
new one that joins the run going on; or a SIGKILL of the Lighthouse, started again at its
address at once from its loaded spare (as ``nn-handler supervise`` does). Reports the
recoveries, the steps redone, the catch-ups (a live member left out of a step's quorum, given
the state at the next), the time from each member's kill to the first committed step its
victim cannot have been part of (p50, p95, for deaths and hangs) and from each Lighthouse's
kill to the run's next commit, and checks that every member that finished holds the bits of a
run that never failed, every step committed with all its samples (by the members killed later
too) and no member committing one twice.

Usage: python tests/scripts/ft_campaign.py [--kills 30] [--seed 51] [--members 4]
       [--hang-share 0.2] [--lighthouse-share 0.2] [--heartbeat-timeout-s 0.5]
       [--out report.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler.training.fault_tolerance import Lighthouse
from tests.ft_helpers import BATCH, batch_of, digest, unfailed
from tests.interpreters import python_path

ROOT = Path(__file__).parents[2]
MEMBER = ROOT / "tests" / "scripts" / "ft_member.py"
TIMEOUT_S, STEP_S = 3.0, 0.05
#: The Lighthouse waits this long for a live member (above TIMEOUT_S: one late after a failure
#: is waited for, not left out to catch up).
JOIN_S = float(os.environ.get("FT_JOIN_S", "10"))


#: The members of a step read its commit within this long of each other (one verdict); two
#: commits of a step further apart are two runs: new members that started the run again.
AGAIN_S = 2.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def campaign(
    kills: int,
    seed: int,
    members: int,
    hang_share: float,
    lighthouse_share: float = 0.0,
    heartbeat_s: float = 0.5,
) -> dict[str, Any]:
    rng = random.Random(seed)
    steps = int(kills * 3.0 / STEP_S)  # about 3 s of steps per kill
    run = Path(tempfile.mkdtemp(prefix="ft-campaign-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": python_path(ROOT), "RUST_LOG": "error", "FT_STEPS": str(steps),
           "FT_STEP_S": str(STEP_S)}  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    events: list[dict[str, Any]] = []

    def start(member: str, starters: int) -> None:
        with open(run / f"{member}.log", "wb") as log:
            procs[member] = subprocess.Popen(
                [sys.executable, str(MEMBER), lighthouse.address, str(run), member, str(starters)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    started = time.time()
    with Lighthouse(
        min_members=2, join_timeout_s=JOIN_S, heartbeat_timeout_s=heartbeat_s, standby=True
    ) as lighthouse:
        for i in range(members):
            start(f"m{i}", members)
        while not all((run / f"m{i}.step").exists() for i in range(members)):
            time.sleep(0.05)
        for n in range(kills):
            time.sleep(rng.uniform(1.5, 3.0))
            if rng.random() < lighthouse_share:  # the coordinator, restarted at once
                events.append({"member": "", "kind": "lighthouse", "time": time.time()})
                lighthouse.kill()
                lighthouse.restart()
                continue
            live = [m for m, p in procs.items() if p.poll() is None and m not in _stopped(events)]
            victim = rng.choice(sorted(live))
            hang = rng.random() < hang_share
            events.append({"member": victim, "kind": "hang" if hang else "death",
                           "time": time.time()})  # fmt: skip
            procs[victim].send_signal(signal.SIGSTOP if hang else signal.SIGKILL)
            start(f"j{n}", 0)  # a new member joins the run going on
        for member, proc in procs.items():
            if member in _stopped(events):
                proc.kill()
            proc.wait(timeout=steps * STEP_S * 4 + 120)
    finished = {m: json.loads((run / f"{m}.json").read_text())
                for m in procs if (run / f"{m}.json").exists()}  # fmt: skip
    commits = {path.stem: _commits(path) for path in run.glob("*.commits")}
    at = {m: int((run / f"{m}.in").read_text()) for m in procs if (run / f"{m}.in").exists()}
    expected = digest(unfailed(steps))
    problems = [f"{m}: stopped: {r['stopped'][:160]}" for m, r in finished.items() if r["stopped"]]
    problems += [
        f"{m}: digest" for m, r in finished.items() if r["digest"] != expected and not r["stopped"]
    ]
    problems += ledger_problems(finished, commits, steps)
    heals = sum(
        sum(b != a + 1 for a, b in itertools.pairwise(own))
        for own in ([e[0] for e in r["ledger"]] for r in finished.values())
    )
    latency: dict[str, list[float]] = {"death": [], "hang": [], "lighthouse": []}
    for event in events:
        victim_at = at.get(event["member"], -1)  # a Lighthouse's kill: any later commit
        recovered = event["recovery_s"] = recovery_s(event, victim_at, commits)
        if recovered is not None:
            latency[event["kind"]].append(recovered)
    return {
        "seed": seed,
        "members": members,
        "kills": len(events),
        "hangs": sum(e["kind"] == "hang" for e in events),
        "lighthouse_kills": sum(e["kind"] == "lighthouse" for e in events),
        "steps": steps,
        "recoveries": sum(len(v) for v in latency.values()),
        "steps_redone": max((r["redone"] for r in finished.values()), default=0),
        "catch_ups": heals,
        "finished_members": sorted(finished),
        "bits_and_ledgers_hold": not problems and len(finished) >= 2,
        "problems": problems,
        "seconds_to_first_step_without_the_victim": {
            kind: _summary(v) for kind, v in latency.items()
        },
        "settings": {
            "timeout_s": TIMEOUT_S,
            "heartbeat_timeout_s": heartbeat_s,
            "join_timeout_s": JOIN_S,
            "step_s": STEP_S,
        },
        "wall_s": time.time() - started,
        "started": started,
        "events": [  # each kill: its kind, victim, time from the campaign's start, recovery
            {**event, "time": round(event["time"] - started, 3)} for event in events
        ],
    }


#: A commit as a member's .commits file has it: (step, time, samples, sum of sample ids).
Commit = tuple[int, float, int, int]


def _commits(path: Path) -> list[Commit]:
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(int(r[0]), float(r[1]), int(r[2]), int(r[3])) for r in rows]


def ledger_problems(
    finished: dict[str, dict[str, Any]], commits: dict[str, list[Commit]], steps: int
) -> list[str]:
    """What is wrong with the run's ledger: a step never committed, a commit of a step without
    all of its samples (by any member: those that finished, and those killed later, from their
    .commits files), a member committing a step twice or out of order (a member left out of a
    step's quorum catches up by a state transfer: a gap in its own is allowed), a step
    committed twice by different members (far apart: the run started again by members that
    missed it; they reach the same bits from the same start, so only the times tell)."""
    problems = []
    seen: dict[int, set[tuple[int, int]]] = {}
    for member, report in finished.items():
        if not _in_order([entry[0] for entry in report["ledger"]]):
            problems.append(f"{member}: a step committed twice or out of order")
        for step, samples, id_sum, *_ in report["ledger"]:
            seen.setdefault(step, set()).add((samples, id_sum))
    for member, rows in commits.items():
        if not _in_order([row[0] for row in rows]):
            problems.append(f"{member}: a step committed twice or out of order")
        for step, _, samples, id_sum in rows:
            seen.setdefault(step, set()).add((samples, id_sum))
    again = sorted(
        step for step, times in _commit_times(commits).items() if max(times) - min(times) > AGAIN_S
    )
    problems += [f"steps committed again, by a run started again: {again[:5]}"] * bool(again)
    missing = [s for s in range(steps) if s not in seen]
    wrong = sorted(s for s, sums in seen.items() if sums != {(BATCH, sum(batch_of(s)))})
    problems += [f"steps never committed: {missing[:5]}"] * bool(missing)
    problems += [f"steps without all their samples: {wrong[:5]}"] * bool(wrong)
    return problems


def _commit_times(commits: dict[str, list[Commit]]) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {}
    for rows in commits.values():
        for step, when, *_ in rows:
            times.setdefault(step, []).append(when)
    return times


def _in_order(own: list[int]) -> bool:
    return own == sorted(set(own))


def recovery_s(event: dict[str, Any], at: int, commits: dict[str, list[Commit]]) -> float | None:
    """The time from a kill to the first commit (by any member) of a step its victim cannot
    have been part of: a step after ``at``, the latest step the victim had been told it is a
    member of when it was killed (ft_member writes it once the step's quorum returns to it: no
    later step's sum can hold its part; -1: none, a new member killed before it joined). A
    commit of step ``at`` itself may hold the victim's vote and does not count. None: no such
    commit (the run ended first)."""
    after = [time for rows in commits.values() for step, time, *_ in rows if step > at]
    later = [time - event["time"] for time in after if time > event["time"]]
    return min(later, default=None)


def _summary(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": _percentile(values, 0.5),
        "p95": _percentile(values, 0.95),
        "max": max(values, default=None),
        "mean": statistics.fmean(values) if values else None,
    }


def _stopped(events: list[dict[str, Any]]) -> set[str]:
    return {e["member"] for e in events if e["kind"] == "hang"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=51)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--hang-share", type=float, default=0.2)
    parser.add_argument("--lighthouse-share", type=float, default=0.2)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=0.5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = campaign(
        args.kills, args.seed, args.members, args.hang_share, args.lighthouse_share,
        args.heartbeat_timeout_s,
    )  # fmt: skip
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    sys.exit(0 if report["bits_and_ledgers_hold"] else 1)


if __name__ == "__main__":
    main()
