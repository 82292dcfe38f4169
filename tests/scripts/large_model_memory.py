"""Train a model built on the meta device and report each rank's memory against the plan.

    torchrun --nproc-per-node=N tests/scripts/large_model_memory.py OUT.json [options]

Every rank writes one JSON line to OUT.json.<rank>: its resident memory before the model
exists (after the imports and the process group), its high-water mark after setup and after
training (Linux VmHWM, reset to the resident memory before each run through
/proc/self/clear_refs), the plan's total and items, and the training losses. Run it with
MALLOC_MMAP_THRESHOLD_=131072 (the test and the benchmark do): otherwise glibc keeps freed
blocks and the high-water mark measures the allocator, not the tensors.

``--micro M`` trains in the reproducible mode (a global batch of ``--batch`` samples in
micro-batches of M, the exact int64 sum). ``--checkpointing none,selective,full`` measures
each mode in turn in the same processes (the model built again for each, the high-water mark
reset between them) and writes OUT.json.<mode>.<rank> for each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint  # imported before the baseline, with the next
import torch.distributed.fsdp
from torch import nn
from torch.utils.data import TensorDataset

import nn_handler.strategies.fsdp  # noqa: F401  (its imports too, before the baseline)
from nn_handler import DistributedContext, NNHandler
from nn_handler.config import DistributedConfig


def reset_peak() -> None:
    """Set VmHWM to the current resident memory (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(self.norm(x)))


def build(width: int, depth: int, classes: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, classes))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--replicate", default="1")
    parser.add_argument("--checkpointing", default="none")
    parser.add_argument("--budget", default=None)
    parser.add_argument(
        "--micro", type=int, default=0, help="the reproducible mode: micro-batch size (0: off)"
    )
    return parser.parse_args()


def train(
    args: argparse.Namespace,
    context: DistributedContext,
    width: int,
    depth: int,
    checkpointing: str = "none",
) -> dict[str, Any]:
    """Train the model of ``width`` x ``depth`` for ``args.steps`` steps; its report."""
    classes = 10
    generator = torch.Generator().manual_seed(0)
    samples = args.batch * args.steps * 4  # enough for 4 ranks
    data = TensorDataset(
        torch.randn(samples, width, generator=generator),
        torch.randint(0, classes, (samples,), generator=generator),
    )
    replicate = args.replicate if args.replicate == "auto" else int(args.replicate)
    config = {
        "loader": {"batch_size": args.batch, "shuffle": False},
        "trainer": {
            "progress_bar": False,
            "strategy": args.strategy,
            "max_steps": args.steps,
            "memory_budget": args.budget,
            "fsdp": {
                "blocks": ["Block"],
                "replicate": replicate,
                "activation_checkpointing": checkpointing,
            },
        },
        "logging": {"enabled": False, "monitor": False},
    }
    if args.micro:  # the reproducible mode: a global batch of --batch in micro-batches
        config["trainer"]["reproducible"] = {
            "global_batch_size": args.batch,
            "micro_batch_size": args.micro,
        }
    reset_peak()
    baseline = status("VmRSS")
    with NNHandler(
        build(width, depth, classes),
        lambda params: torch.optim.Adam(params, lr=1e-3),
        nn.CrossEntropyLoss(),
        config=config,
        context=context,
    ) as handler:
        after_setup = status("VmHWM")
        handler.train(data, epochs=1)
        peak = status("VmHWM")
        memory = handler.trainer.memory
        plan = memory.plan
        if plan is None:
            raise RuntimeError("no memory plan")
        return {
            "rank": handler.rank,
            "world": handler.world_size,
            "baseline": baseline,
            "setup_peak": after_setup - baseline,
            "peak": peak - baseline,
            "plan": plan.total,
            "items": {name: size for name, size, _ in plan.items},
            "budget": memory.budget,
            "model_state": 16 * sum(p.numel() for p in handler.trainer.module.parameters()),
            "losses": [r["train_loss"] for r in handler.history.records],
        }


def main() -> None:
    args = parse()
    modes = args.checkpointing.split(",")
    with DistributedContext(DistributedConfig(enabled=True)) as context:
        # The libraries' own memory (lazy imports, first-call caches) is not the model's:
        # one tiny run in each mode first, then the baselines.
        for mode in modes:
            train(args, context, 16, 2, mode)
        for mode in modes:
            report = train(args, context, args.width, args.depth, mode)
            name = args.out if len(modes) == 1 else f"{args.out}.{mode}"
            Path(f"{name}.{report['rank']}").write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
