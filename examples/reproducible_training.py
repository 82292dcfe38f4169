"""Bit-identical training at any world size (TrainerConfig.reproducible): the digits CNN with
BatchNorm, trained on 1, 2, 3 or 4 processes, ends with the same weights, optimizer state and
History, to the last bit. The script prints the validation accuracy and a SHA-256 of the final
state; run it with several world sizes and compare:

    python examples/reproducible_training.py
    torchrun --nproc-per-node 2 examples/reproducible_training.py
    torchrun --nproc-per-node 3 examples/reproducible_training.py

Each optimizer step takes the same 64 samples, cut into 4 micro-batches of 16, whatever the
number of ranks (docs/reproducible.md). What must match between the runs: the device type, the
dtype, the threads per process (one here), and the torch version.

With ``--fault-tolerant`` (one command, the `ft` extra) it starts a Lighthouse and three
members, processes of their own (trainer.fault_tolerance, docs/fault-tolerance.md); member m1
is killed in a random step, the other two redo it without it and finish: each prints the same
SHA-256 as the run in one process.

    python examples/reproducible_training.py --fault-tolerant
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys

import torch
from torch import nn

from nn_handler import Hook, NNHandler, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets


def state_digest(handler: NNHandler) -> str:
    """SHA-256 of the weights, buffers and optimizer state (every rank holds the same)."""
    sha = hashlib.sha256()
    optimizer = handler.trainer.optimizer
    tensors = dict(handler.model.state_dict())
    if optimizer is not None:
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v for k, v in state.items()})
    for name in sorted(tensors):
        value = torch.as_tensor(tensors[name]).detach().cpu().contiguous()
        sha.update(name.encode() + value.view(-1).view(torch.uint8).numpy().tobytes())
    for record in handler.history:
        sha.update(f"{record['train_loss'].hex()} {record['val_loss'].hex()}".encode())
    return sha.hexdigest()


class DieAt(Hook):
    """Kills this process (SIGKILL, as a lost machine) in the given optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self) -> None:
        if self.trainer.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def train(member: str | None, lighthouse: str | None, die_at: int | None) -> None:
    torch.set_num_threads(1)  # the same threads per process at every world size
    train, val = digits_datasets()
    torch.manual_seed(0)
    trainer = {
        "progress_bar": False,
        "reproducible": {"global_batch_size": 64, "micro_batch_size": 16},
    }
    if member is not None:  # one member of a fault-tolerant run, a process of its own
        trainer["fault_tolerance"] = {
            "lighthouse": lighthouse, "member_id": member, "min_members": 1, "start_members": 3,
        }  # fmt: skip
    config = {"loader": {"batch_size": 64, "seed": 0}, "trainer": trainer}
    with NNHandler(
        DigitsCNN(batchnorm=True),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config,
        metrics={"accuracy": accuracy},
        hooks=[DieAt(die_at)] if die_at is not None else [],
    ) as handler:
        history = handler.train(train, val, epochs=4)
        digest = state_digest(handler)
        if handler.is_main_process:
            who = f"member {member}" if member else f"world size {handler.world_size}"
            line = f"{who}: val_accuracy={history.last['val_accuracy']:.4f} sha256={digest}"
            sys.stdout.write(line + "\n")  # one write (print's newline is another): the
            sys.stdout.flush()  # members print side by side, into one pipe


def fault_tolerant_demo() -> None:
    """A Lighthouse and three members; m1 dies in a random step of the 100 (4 epochs)."""
    from nn_handler.training.fault_tolerance import Lighthouse

    step = random.randint(5, 90)
    # torchft's Rust side logs every step at INFO unless RUST_LOG says otherwise.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    with Lighthouse(min_members=1) as lighthouse:
        members = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--member",
                    f"m{i}",
                    "--lighthouse",
                    lighthouse.address,
                    *(["--die-at-step", str(step)] if i == 1 else []),
                ],
                env=env,
            )
            for i in range(3)
        ]
        codes = [member.wait() for member in members]
    print(f"m1 was killed in step {step + 1} (exit {codes[1]}); m0 and m2 exited {codes[0]}, "
          f"{codes[2]}, no process restarted")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fault-tolerant", action="store_true", help="the demo (see above)")
    parser.add_argument("--member", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--die-at-step", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fault_tolerant:
        fault_tolerant_demo()
    else:
        train(args.member, args.lighthouse, args.die_at_step)


if __name__ == "__main__":
    main()
