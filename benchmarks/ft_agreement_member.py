"""One process of benchmarks/ft_agreement.py (not a benchmark by itself): the same small job
as an nn_handler member (trainer.fault_tolerance over the reproducible mode), as a member of
torchft's own Manager-based loop, or as either one alone (no fault tolerance: the baseline).

Usage: python ft_agreement_member.py KIND OUT STEPS MEMBERS [LIGHTHOUSE MEMBER_ID]
KIND: ``nn_handler`` or ``torchft``; without LIGHTHOUSE the job runs alone in this process.

The job: a tiny MLP, a global batch of 64 samples (16 micro-batches of 4 in the reproducible
mode), and a step whose compute is mostly a sleep of STEP_SLEEP_S in its first forward (so that
16 members on 2 cores measure the agreement, not the cores' sharing). OUT gets the JSON list of
the times (time.perf_counter) at which each optimizer step ended.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The step's emulated compute (once per step, in its first forward).
STEP_SLEEP_S = 0.3
GLOBAL_BATCH, MICRO_BATCH, FEATURES = 64, 4, 16


class SleepyMLP(nn.Module):
    """A tiny MLP whose first forward after ``arm()`` sleeps STEP_SLEEP_S."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 4))
        self.armed = True

    def arm(self) -> None:
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.armed:
            self.armed = False
            time.sleep(STEP_SLEEP_S)
        return self.net(x)


def dataset(steps: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))


def nn_handler_job(
    steps: int, members: int, lighthouse: str | None, member: str | None
) -> list[float]:
    from nn_handler import NNHandler
    from nn_handler.training.hooks import Hook

    ends: list[float] = []

    class StepEnds(Hook):
        def after_optimizer_step(self) -> None:
            ends.append(time.perf_counter())
            model.arm()

    trainer: dict[str, Any] = {
        "progress_bar": False,
        "model_summary": False,
        "max_steps": steps,
        "reproducible": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH},
    }
    if lighthouse is not None:
        trainer["fault_tolerance"] = {
            "lighthouse": lighthouse, "member_id": member, "start_members": members,
            "timeout_s": 10.0, "quorum_timeout_s": 60.0,
        }  # fmt: skip
    torch.manual_seed(0)
    model = SleepyMLP()
    handler = NNHandler(
        model,
        lambda p: torch.optim.SGD(p, lr=0.05),
        nn.CrossEntropyLoss(),
        hooks=[StepEnds()],
        config={"loader": {"seed": 3}, "trainer": trainer, "logging": {"level": "WARNING"}},
    )
    handler.train(dataset(steps), epochs=1)
    handler.close()
    return ends


def torchft_job(
    steps: int, members: int, lighthouse: str | None, member: str | None
) -> list[float]:
    """torchft's own loop (its README's): start_quorum, forward, backward, the gradients'
    allreduce through the Manager, should_commit, the optimizer's step."""
    torch.manual_seed(0)
    model = SleepyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    data = dataset(steps)
    manager: Any = None
    index = 0 if member is None else int(member.removeprefix("m"))
    if lighthouse is not None:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
            min_replica_size=members,
            load_state_dict=lambda state: model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            lighthouse_addr=lighthouse,
            replica_id=member,
            hostname="127.0.0.1",
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=60),
        )
    share = GLOBAL_BATCH // (members if manager is not None else 1)
    ends: list[float] = []
    for step in range(steps):
        if manager is not None:
            manager.start_quorum()
        first = step * GLOBAL_BATCH + index * share
        x, y = data.tensors[0][first : first + share], data.tensors[1][first : first + share]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if manager is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            manager.allreduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if not manager.should_commit():
                continue
        optimizer.step()
        ends.append(time.perf_counter())
        model.arm()
    if manager is not None:
        manager.shutdown(wait=False)
    return ends


def main(kind: str, out: Path, steps: int, members: int, *ft: str) -> None:
    torch.set_num_threads(1)
    lighthouse, member = (ft[0], ft[1]) if ft else (None, None)
    job = nn_handler_job if kind == "nn_handler" else torchft_job
    ends = job(steps, members, lighthouse, member)
    out.write_text(json.dumps(ends))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
