"""Run by tests/distributed/test_group_members.py (not by pytest): one rank of a member of
several ranks in a fault-tolerant run of tests/ft_helpers.py's problem. Group rank i trains its
own problem (seed i: a shard of its own), summed with rank i of the other members; it may
SIGKILL itself before the sum of a step.

Usage: python ft_group_member.py LIGHTHOUSE RUN_DIR MEMBER GROUP_RANK GROUP_SIZE STORE_PORT
STARTERS [KILL_STEP]
STARTERS: how many members start together (each rank waits for the others' ready-* files; 0:
join a run already going). RUN_DIR/<member>-<rank>.step has the step it is at; with
FT_HOLD_AT=N it waits before step N until RUN_DIR/release-N exists; RUN_DIR/<member>-<rank>.json
gets the report: the steps, the final weights' SHA-256, the ledger (step, samples, sum of sample
ids, members), the attempts redone, and whether it joined (received a live member's state).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler.errors import PeerLostError
from nn_handler.training.fault_tolerance import Replica
from tests.ft_helpers import FEATURES, STEPS, apply, batch_of, data, digest, slots


def main(argv: list[str]) -> None:
    lighthouse, run_dir, member, group_rank, group_size, port, starters, *kill = argv
    run, rank, starting = Path(run_dir), int(group_rank), int(starters)
    name, kill_step = f"{member}-{rank}", int(kill[0]) if kill else -1
    x, y = data(seed=rank)
    w = torch.zeros(FEATURES, dtype=torch.float64)
    joined: list[int] = []

    def take(state: dict[str, torch.Tensor]) -> None:
        w.copy_(state["w"])
        joined.append(1)

    replica = Replica(
        lighthouse, member, state_dict=lambda: {"w": w}, load_state_dict=take, min_members=1,
        timeout_s=3.0, quorum_timeout_s=20.0, init_sync=False, group_rank=rank,
        group_size=int(group_size), store_port=int(port),
    )  # fmt: skip
    (run / f"ready-{name}").touch()
    while len(list(run.glob("ready-*"))) < starting * int(group_size):
        time.sleep(0.01)
    holds = {int(step) for step in os.environ.get("FT_HOLD_AT", "").split(",") if step}
    ledger, redone, begun = [], 0, False
    while replica.step < STEPS:
        (run / f"{name}.step").write_text(str(replica.step))
        if replica.step in holds:
            end = time.monotonic() + 60
            while not (run / f"release-{replica.step}").exists() and time.monotonic() < end:
                time.sleep(0.01)
        if begun:
            replica.next_attempt()
        else:
            replica.begin_step(starting or None)
            begun = True
        step, members = replica.step, replica.members
        mine = [i for j, i in enumerate(batch_of(step, rank)) if j % members == replica.rank]
        row = slots(w, mine, x, y)
        time.sleep(0.05)
        if step == kill_step:  # as torchrun stops a member's ranks when one of them dies
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            summed = replica.communicator.all_reduce(row)
        except PeerLostError:
            summed = None
        if replica.commit(str(step)) and summed is not None:
            apply(w, summed)
            ledger.append([step, int(summed[FEATURES]), int(summed[FEATURES + 1]), members])
        else:
            redone += 1
    replica.finish()
    replica.close()
    report = {"steps": replica.step, "digest": digest(w), "ledger": ledger, "redone": redone,
              "joined": bool(joined)}  # fmt: skip
    (run / f"{name}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
