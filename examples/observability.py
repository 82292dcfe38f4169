"""See a run: trackers, throughput, where each step's time goes, a profile.

    python examples/observability.py --dir runs/obs                      # one process
    torchrun --nproc-per-node=2 examples/observability.py --dir runs/obs
    python examples/observability.py --dir runs/obs --slow-data 0.002    # a slow loader

Trains the digits CNN for two epochs with a CSV and an MLflow tracker (``pip install
'nn_handler[mlflow]'``; a SQLite store in --dir), the throughput monitor (on by default; here
with tokens counted as pixels) and the profiler over three steps. Each epoch's log line ends
with the step anatomy; with --slow-data every sample takes that many seconds to load and the
line ends with the verdict "data-bound: ...". docs/observability.md walks through the output.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from nn_handler import NNHandler, ThroughputMonitor, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets


class SlowLoading(Dataset[Any]):
    """Another dataset whose samples each take ``seconds`` to load (a slow disk)."""

    def __init__(self, data: Dataset[Any], seconds: float) -> None:
        self.data, self.seconds = data, seconds

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds)
        return self.data[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="the run folder (trackers and traces)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--slow-data", type=float, default=0.0, help="seconds per sample")
    args = parser.parse_args()
    run = Path(args.dir)

    torch.manual_seed(0)
    train, val = digits_datasets()
    if args.slow_data > 0:
        train = SlowLoading(train, args.slow_data)
    config = {
        "loader": {"batch_size": 32, "shuffle": True, "seed": 0},
        "trainer": {
            "progress_bar": False,
            "profile": {"dir": str(run / "profile"), "skip_first": 2, "active": 3},
        },
        "logging": {
            "dir": str(run),  # the trackers' files: run/csv, run/mlflow.db
            "trackers": ["csv", {"type": "mlflow", "experiment": "digits"}],
        },
    }
    # The monitor NNHandler adds by default, given here to count tokens (pixels per batch).
    monitor = ThroughputMonitor(count_tokens=lambda batch: batch[0][:, 0].numel())
    with NNHandler(
        DigitsCNN(),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config,
        metrics={"accuracy": accuracy},
        hooks=[monitor],
    ) as handler:
        history = handler.train(train, val, epochs=args.epochs)
        if handler.is_main_process:
            last = history.last
            print(
                f"val_accuracy={last['val_accuracy']:.3f} "
                f"samples/s={last['samples_per_sec']:.0f} "
                f"pixels/s={last['tokens_per_sec']:.3g} "
                f"GFLOP/s={1000 * last['tflops']:.3g} step_ms={last['step_ms']:.2f}"
            )
            print(f"verdict: {monitor.last_verdict or 'compute-bound (no part dominates)'}")
            print(f"metrics: {run / 'csv' / 'metrics.csv'}, mlflow: sqlite:///{run}/mlflow.db")
            print(f"traces: {sorted(p.name for p in (run / 'profile').glob('*.json'))}")


if __name__ == "__main__":
    main()
