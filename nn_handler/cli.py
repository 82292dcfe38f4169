"""The ``nn-handler`` console script."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from nn_handler.config.checkpoint import is_url
from nn_handler.planning.command import add_plan_parser, run_plan_command


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


def _run_folder(out: str | None, resume: bool) -> Path:
    if out is not None:
        return Path(out)
    runs = sorted(Path("runs").glob("demo-*"))
    if resume:
        if not runs:
            raise SystemExit("nn-handler: error: --resume found no runs/demo-* folder; pass --out")
        return runs[-1]
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def demo_placement(nproc: int, gpus: int, backend: str) -> tuple[str, str, str | None]:
    """(backend, device, note) for the demo: one GPU per process when there are enough GPUs,
    otherwise every process on the CPU with gloo (with a note when GPUs were left unused). An
    explicit nccl is passed through (the context then explains what is missing)."""
    if 0 < nproc <= gpus:
        return backend, "auto", None
    if backend == "nccl":
        return backend, "auto", None
    note = f"{nproc} processes but {gpus} GPU(s): the demo runs on the CPU with gloo"
    return "gloo", "cpu", note if gpus else None


def run_demo(args: argparse.Namespace) -> int:
    """Train the digits CNN on ``args.nproc`` local processes with torchrun over 127.0.0.1."""
    import torch

    out = _run_folder(args.out, args.resume)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, device, note = demo_placement(args.nproc, gpus, args.backend)
    if args.precision == "fp16" and (device == "cpu" or gpus == 0):
        # Checked here, once, rather than as a ConfigError traceback from every rank.
        print(
            "nn-handler demo: error: --precision fp16 needs CUDA (float16 autocast with a "
            "GradScaler) and this run is on the CPU; use --precision bf16 (or amp, which picks "
            "bf16 on the CPU)",
            file=sys.stderr,
        )
        return 2
    if note:
        print(f"nn-handler demo: {note}")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "-m",
        "nn_handler.demo",
        f"--out={out}",
        f"--epochs={args.epochs}",
        f"--precision={args.precision}",
        f"--backend={backend}",
        f"--device={device}",
    ]
    command += ["--ema"] if args.ema else []
    command += ["--resume"] if args.resume else []
    env = dict(os.environ)  # the children's environment, not ours
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the demo stays on this machine
    return subprocess.call(command, env=env)


def run_env(env: Mapping[str, str]) -> int:
    """Print what nn_handler sees; 1 when the launcher variables are inconsistent."""
    import torch
    import torch.distributed as dist

    from nn_handler.distributed.env import parse_distributed_env
    from nn_handler.errors import ConfigError

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    available = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    print("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in available.items()))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            print(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        print("CUDA: no devices")
    try:
        info = parse_distributed_env(env)
    except ConfigError as error:
        print(f"launcher variables: INCONSISTENT: {error}")
        return 1
    print(f"launcher: {info.launcher}")
    print(f"  {info}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nn-handler", description="nn_handler: distributed PyTorch training."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on the bundled digits dataset with N local processes",
        description="Train a small CNN on scikit-learn's digits with N processes (torchrun on "
        "127.0.0.1): progress bar, per-epoch summaries, checkpoints, a curves PNG.",
    )
    demo.add_argument("--nproc", type=_positive_int, default=2, help="processes (default 2)")
    demo.add_argument("--epochs", type=_positive_int, default=10, help="default 10")
    demo.add_argument("--precision", choices=["32", "bf16", "fp16", "amp"], default="32")
    demo.add_argument("--ema", action="store_true", help="keep an EMA of the weights")
    demo.add_argument("--out", help="run folder (default: runs/demo-<time>)")
    demo.add_argument(
        "--resume", action="store_true", help="continue the run in --out (default: newest)"
    )
    demo.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="default: auto"
    )
    commands.add_parser(
        "env",
        help="print torch, backends, CUDA devices and the launcher environment",
        description="Print what nn_handler sees: torch version, distributed backends, CUDA "
        "devices and memory, and the DistributedInfo parsed from the environment.",
    )
    checkpoint = commands.add_parser(
        "checkpoint",
        help="look into a checkpoint, or make one file of a sharded one",
        description="Tools for checkpoint files and sharded checkpoint folders.",
    )
    tools = checkpoint.add_subparsers(dest="tool", required=True)
    inspect = tools.add_parser(
        "inspect",
        help="print what a checkpoint holds: position, parts and their sizes, ranks",
        description="Print what a checkpoint file (read weights-only, memory-mapped) or a "
        "sharded checkpoint folder (its index, not its shards) holds.",
    )
    inspect.add_argument(
        "path", help="a checkpoint file or sharded checkpoint folder (or its URL, s3://...)"
    )
    consolidate = tools.add_parser(
        "consolidate",
        help="write a sharded checkpoint folder as one weights-only file",
        description="Write the sharded checkpoint DIR as the single file OUT: the whole "
        "model and EMA and the small parts, without the optimizers' states; NNHandler.load "
        "restores it in one process.",
    )
    consolidate.add_argument(
        "folder", metavar="DIR", help="a sharded checkpoint folder (or its URL, s3://...)"
    )
    consolidate.add_argument("out", metavar="OUT", help="the file to write (e.g. model.pt)")
    lighthouse = commands.add_parser(
        "lighthouse",
        help="run the coordinator of a fault-tolerant run (trainer.fault_tolerance)",
        description="Run a torchft Lighthouse until stopped: it decides each step's members of "
        "a fault-tolerant run from their heartbeats. Run it where no member runs.",
    )
    lighthouse.add_argument("--host", default="127.0.0.1", help="address to listen on")
    lighthouse.add_argument("--port", type=int, default=29510, help="0: a free one")
    lighthouse.add_argument("--min-members", type=_positive_int, default=1)
    lighthouse.add_argument("--join-timeout-s", type=float, default=60.0)
    lighthouse.add_argument("--heartbeat-timeout-s", type=float, default=1.0)
    lighthouse.add_argument(
        "--standby",
        action="store_true",
        help="load, then wait for a line on stdin before listening (a warm spare for a "
        "restart at the same address)",
    )
    supervise = commands.add_parser(
        "supervise",
        help="run a fault-tolerant run's members on this machine, restarting only a dead one",
        description="Start a Lighthouse (unless --lighthouse names one) and N members, each a "
        "process running COMMAND with {member} (m0, m1...) and {lighthouse} (its address) in "
        "place; a member that fails is restarted with the same name, and joins the run.",
    )
    supervise.add_argument("--members", type=_positive_int, required=True)
    supervise.add_argument("--max-restarts", type=int, default=3, help="per member")
    supervise.add_argument("--lighthouse", default=None, help="a Lighthouse already running")
    supervise.add_argument("--host", default="127.0.0.1", help="the Lighthouse's address")
    supervise.add_argument("--min-members", type=_positive_int, default=1)
    supervise.add_argument("--join-timeout-s", type=float, default=60.0)
    supervise.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=1.0,
        help="a member silent that long is left out of the next step (a death's recovery "
        "takes about this long)",
    )
    supervise.add_argument(
        "program", metavar="COMMAND", nargs=argparse.REMAINDER, help="-- then the command"
    )
    add_plan_parser(commands)
    return parser


def run_inspect(path: str) -> int:
    """Print the checkpoint's description; 1 with the reason when it cannot be read."""
    from nn_handler.checkpoint.inspect import describe_checkpoint
    from nn_handler.checkpoint.opening import open_checkpoint
    from nn_handler.errors import CheckpointError

    try:  # a folder of checkpoints (or a URL of one): its newest, as a resume chooses it
        print(describe_checkpoint(open_checkpoint(path, glance=True)))
    except (CheckpointError, OSError) as error:
        print(f"nn-handler checkpoint inspect: {error}", file=sys.stderr)
        return 1
    return 0


def run_consolidate(folder: str, out: str) -> int:
    """Write the consolidated file; 1 with the reason when the folder cannot be read."""
    from nn_handler.checkpoint.consolidate import consolidate
    from nn_handler.checkpoint.opening import open_checkpoint
    from nn_handler.errors import CheckpointError

    try:
        if is_url(out):
            raise CheckpointError(f"consolidate writes a local file; {out} is a URL.")
        written = consolidate(open_checkpoint(folder, glance=True).path, out)
    except (CheckpointError, OSError) as error:
        print(f"nn-handler checkpoint consolidate: {error}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def run_lighthouse(args: argparse.Namespace) -> int:
    """Serve until stopped; 1 with the reason when it cannot start."""
    from nn_handler.errors import ConfigError
    from nn_handler.training.fault_tolerance.lighthouse import serve

    try:
        serve(
            args.host,
            args.port,
            args.min_members,
            args.join_timeout_s,
            args.heartbeat_timeout_s,
            standby=args.standby,
        )
    except (ConfigError, RuntimeError, OSError) as error:
        print(f"nn-handler lighthouse: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_supervise(args: argparse.Namespace) -> int:
    """The members' run; 1 (or 2 for a bad command) when it did not end well."""
    from nn_handler.errors import ConfigError, DistributedError
    from nn_handler.log import disable_logging, enable_logging
    from nn_handler.training.fault_tolerance.supervisor import Supervisor

    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        supervisor = Supervisor(
            command,
            args.members,
            max_restarts=args.max_restarts,
            lighthouse=args.lighthouse,
            min_members=args.min_members,
            join_timeout_s=args.join_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            host=args.host,
        )
    except ConfigError as error:  # its message starts with "supervise:"
        print(f"nn-handler {error}", file=sys.stderr)
        return 2
    # Its lines (the Lighthouse's address, each restart, each end), named apart from the
    # members' ('member m1'), which share its terminal.
    logs = enable_logging(label="supervise")
    # SIGTERM (a scheduler's stop) ends the run as Ctrl-C does: the members are stopped too.
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        return supervisor.run()
    except (ConfigError, DistributedError) as error:  # a program not found, no Lighthouse
        print(f"nn-handler supervise: {str(error).removeprefix('supervise: ')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        disable_logging(logs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "env":
        return run_env(os.environ)
    if args.command == "checkpoint" and args.tool == "consolidate":
        return run_consolidate(args.folder, args.out)
    if args.command == "checkpoint":
        return run_inspect(args.path)
    if args.command == "lighthouse":
        return run_lighthouse(args)
    if args.command == "supervise":
        return run_supervise(args)
    if args.command == "plan":
        return run_plan_command(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
