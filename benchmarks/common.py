"""What every benchmark script shares: its command line, the machine facts, the JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few seconds, for smoke tests")
    parser.add_argument("--out", help="write the results as JSON to this path")
    return parser.parse_args()


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def report(results: dict[str, Any], out: str | None) -> None:
    """Print the results (with the machine and command first) and write them to ``out``."""
    full = {"machine": machine(), "command": " ".join(sys.argv), **results}
    print(json.dumps(full, indent=2))
    if out:
        with open(out, "w") as handle:
            json.dump(full, handle, indent=2)
