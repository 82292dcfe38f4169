"""Members of several ranks (Replica's group_rank / group_size) with real processes: two
members of 2 ranks each (4 processes) and a Lighthouse; rank i of each member sums with rank i
of the other (its own replica group), and a step commits once every rank of every member
voted done. One rank of a member dies in a step and the member's other rank is stopped half a
second later (torchrun's agent stops a member's ranks when one dies; the survivor of the two
may vote on the step meanwhile): the other member redoes the step alone. A member of 2 ranks
started again joins, each rank receiving the state of the same rank of the live member; every
rank ends with the bits of a run that never failed, and every step is committed once with all
its samples. (tests/scripts/ft_group_member.py is a member's rank.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from nn_handler.training.fault_tolerance import Lighthouse
from tests.ft_helpers import BATCH, FEATURES, STEPS, apply, batch_of, data, digest, slots
from tests.harness import free_port
from tests.interpreters import python_path
from tests.timeouts import scaled

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_group_member.py"
ROOT = SCRIPT.parents[2]
RANKS = 2


def _unfailed(rank: int) -> str:
    """The SHA-256 of group rank ``rank``'s weights after the run, in one process."""
    x, y = data(seed=rank)
    w = torch.zeros(FEATURES, dtype=torch.float64)
    for step in range(STEPS):
        apply(w, slots(w, batch_of(step, rank), x, y))
    return digest(w)


def _start(lighthouse: str, run: Path, member: str, starters: int, *kill: str) -> dict[str, Any]:
    """The ranks of ``member`` (a store port of its own), each logging to RUN/<member>-<r>.log;
    ``kill`` (a step) is its last rank's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": python_path(ROOT), "RUST_LOG": "error"}  # fmt: skip
    port, procs = str(free_port()), {}
    for rank in range(RANKS):
        last = kill if rank == RANKS - 1 else ()
        args = [lighthouse, str(run), member, str(rank), str(RANKS), port, str(starters), *last]
        with open(run / f"{member}-{rank}.log", "wb") as log:
            procs[f"{member}-{rank}"] = subprocess.Popen(
                [sys.executable, str(SCRIPT), *args],
                env={**env, **({"FT_HOLD_AT": "9"} if member == "m0" else {})},
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
    return procs


def _logs(run: Path, procs: dict[str, Any]) -> str:
    return "\n".join(
        f"--- {name} (exit {proc.poll()}):\n{(run / f'{name}.log').read_text()[-3000:]}"
        for name, proc in procs.items()
    )


def test_a_member_of_two_ranks_dies_whole_and_one_joins_rank_by_rank(tmp_path: Path) -> None:
    deadline = time.monotonic() + scaled(150)
    procs: dict[str, Any] = {}
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    try:
        with lighthouse:
            procs.update(_start(lighthouse.address, tmp_path, "m0", 2))
            procs.update(_start(lighthouse.address, tmp_path, "m1", 2, "5"))
            try:  # rank 1 of m1 dies in step 5; its rank 0 goes on until torchrun stops it
                procs["m1-1"].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"m1-1 did not die in step 5:\n{_logs(tmp_path, procs)}")
            time.sleep(0.5)  # the agent's SIGTERM grace: m1-0 may vote on step 5 meanwhile
            procs["m1-0"].send_signal(signal.SIGKILL)
            procs["m1-0"].wait()
            procs.update(_start(lighthouse.address, tmp_path, "m1b", 0))  # started again
            while len(list(tmp_path.glob("ready-m1b-*"))) < RANKS:
                if time.monotonic() > deadline:
                    pytest.fail(f"m1b never had its replicas:\n{_logs(tmp_path, procs)}")
                time.sleep(0.02)
            (tmp_path / "release-9").touch()  # m0 waited before step 9: m1b joins there
            for name, proc in procs.items():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{name} did not finish (a hang):\n{_logs(tmp_path, procs)}")
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()
    codes = {name: proc.returncode for name, proc in procs.items()}
    assert codes == {"m0-0": 0, "m0-1": 0, "m1-0": -signal.SIGKILL, "m1-1": -signal.SIGKILL,
                     "m1b-0": 0, "m1b-1": 0}, _logs(tmp_path, procs)  # fmt: skip
    for rank in range(RANKS):
        live = json.loads((tmp_path / f"m0-{rank}.json").read_text())
        joiner = json.loads((tmp_path / f"m1b-{rank}.json").read_text())
        assert live["digest"] == joiner["digest"] == _unfailed(rank), _logs(tmp_path, procs)
        assert [entry[0] for entry in live["ledger"]] == list(range(STEPS))
        for step, samples, id_sum, _members in live["ledger"]:
            assert (samples, id_sum) == (BATCH, sum(batch_of(step, rank))), step
        assert live["redone"] >= 1 and not live["joined"]  # step 5, without m1
        assert joiner["joined"] and joiner["ledger"][0][0] >= 9  # from the state of m0-<rank>
        assert {entry[3] for entry in joiner["ledger"]} == {2}  # with m0, to the end
