"""The ``nn-handler`` console script."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(nproc: int, backend: str) -> int:
    """Start ``nproc`` demo workers on this machine with torchrun over 127.0.0.1."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "-m",
        "nn_handler.demo",
        f"--backend={backend}",
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the demo stays on this machine
    return subprocess.call(command, env=env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nn-handler", description="nn_handler: distributed PyTorch training."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="start N local processes that report their DistributedInfo and all_gather"
    )
    demo.add_argument("--nproc", type=_positive_int, default=2, help="processes (default 2)")
    demo.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="default: auto"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return run_demo(args.nproc, args.backend)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
