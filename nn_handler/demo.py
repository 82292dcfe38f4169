"""The worker of ``nn-handler demo``: train the digits CNN on every rank with NNHandler.

Run by torchrun (``nn-handler demo`` starts it). Rank 0 shows a progress bar and one summary
line per epoch; checkpoints go to OUT/checkpoints after every epoch; at the end rank 0 prints
the final validation accuracy, the throughput and where the step's time went (the step
anatomy and its verdict), and writes OUT/curves.png, OUT/history.json and OUT/history.csv.
``--resume`` continues from the latest checkpoint in OUT.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from nn_handler.config import HandlerConfig
from nn_handler.digits import DigitsCNN, digits_datasets
from nn_handler.handler import NNHandler
from nn_handler.monitoring import ThroughputMonitor
from nn_handler.training.metrics import accuracy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nn_handler.demo")
    parser.add_argument("--out", required=True, help="the run folder")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16", "amp"])
    parser.add_argument("--ema", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="auto", help="auto: cuda:<local rank> or cpu")
    return parser


@record  # torchrun's report then names the real exception of a failing rank
def anatomy(record: dict[str, float], monitor: ThroughputMonitor | None) -> str:
    """The last epoch's throughput and where rank 0's step time went, for the summary."""
    rate = record["samples_per_sec"]
    lines = [f"  throughput: {rate:.0f} samples/s"]
    if "samples_per_sec_rank" in record:
        lines[0] += f" ({record['samples_per_sec_rank']:.0f} on rank 0)"
    if "tflops" in record:
        lines[0] += f", {1000 * record['tflops']:.3g} GFLOP/s on rank 0"
    if "step_ms" in record:
        parts = [
            f"{label} {record[key]:.0f}%"
            for key, label in (
                ("data_wait_pct", "waiting for data"),
                ("compute_pct", "compute"),
                ("exposed_comm_pct", "exposed gradient reduction"),
                ("checkpoint_pct", "checkpoints"),
            )
            if key in record
        ]
        lines.append(
            f"  step anatomy (last epoch, rank 0): {record['step_ms']:.1f} ms per step: "
            f"{', '.join(parts)}; peak memory {record['peak_mem_mb']:.0f} MB"
        )
    if monitor is not None:
        lines.append(f"  verdict: {monitor.last_verdict or 'no part dominates the step'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    out = Path(args.out)
    started = time.perf_counter()
    config = HandlerConfig.from_dict(
        {
            "distributed": {
                "backend": args.backend,
                "device": args.device,
                "timeout": timedelta(seconds=120),
            },
            "loader": {"batch_size": 32, "shuffle": True, "seed": 0},
            "precision": args.precision,
            "ema": {"enabled": args.ema, "decay": 0.99, "warmup": True},
            "logging": {"enabled": True},
            "checkpoint": {
                "dir": str(out / "checkpoints"),
                "save_best": True,
                "monitor": "val_accuracy",
                "mode": "max",
                "keep_last": 2,
                "resume": "auto" if args.resume else "on_restart",
            },
        }
    )
    torch.manual_seed(0)
    train, val = digits_datasets()
    with NNHandler(
        DigitsCNN(),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs),
        config=config,
        metrics={"accuracy": accuracy},
    ) as handler:
        history = handler.train(train, val, epochs=args.epochs)
        if handler.is_reporting_process:
            history.to_json(out / "history.json")
            history.to_csv(out / "history.csv")
            plot = history.plot(out / "curves.png")
            seconds = time.perf_counter() - started
            print(
                f"nn_handler demo: {handler.world_size} processes on {handler.device}, "
                f"{len(history)} epochs, final validation accuracy "
                f"{history['val_accuracy'][-1]:.2%} ({seconds:.1f} s)"
            )
            print(anatomy(history.last, handler.monitor))
            print(f"  run folder: {out.resolve()}")
            print(f"  curves: {plot}; history: history.json, history.csv")
            print(f"  checkpoints: {out / 'checkpoints'} (continue with --resume --out {out})")


if __name__ == "__main__":
    main()
