"""Start a process group of N local processes and run a function in each (seed 003's launcher).

``launch(fn, world_size, *args, **kwargs)`` is the local counterpart of torchrun for code that
lives in a script or a notebook: each child gets the variables a launcher sets (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, and OMP_NUM_THREADS=1 unless set, as torchrun does),
joins a process group through a FileStore in a private temporary folder, runs ``fn``, and tears
the group down. Across machines, use torchrun (see docs/launching.md).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from nn_handler.config import Backend, DistributedConfig
from nn_handler.distributed.context import DistributedContext, resolve_backend
from nn_handler.distributed.processes import run_in_processes
from nn_handler.errors import ConfigError

_STORE_VARIABLE = "NN_HANDLER_LAUNCH_STORE"


def resolve_launch_backend(backend: str, world_size: int) -> Backend:
    """'auto': nccl when CUDA is available, else gloo. nccl needs CUDA and one GPU per process."""
    cuda = torch.cuda.is_available()
    resolved = resolve_backend(backend, torch.device("cuda" if cuda else "cpu"))
    if resolved == "nccl" and torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"backend 'nccl' needs one GPU per process: world_size={world_size} but "
            f"{torch.cuda.device_count()} CUDA device(s) are visible. Use fewer processes or "
            f"backend='gloo'."
        )
    if resolved not in ("gloo", "nccl", "mpi"):
        raise ConfigError(f"backend={backend!r} is not one of 'auto', 'gloo', 'nccl', 'mpi'.")
    return resolved


def _child_env(world_size: int, rank: int, workdir: Path) -> Mapping[str, str]:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        _STORE_VARIABLE: str(workdir / "store"),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _run_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: Backend,
    timeout: timedelta,
    pass_rank: bool,
    rank: int,
) -> Any:
    config = DistributedConfig(
        backend=backend, timeout=timeout, init_method=f"file://{os.environ[_STORE_VARIABLE]}"
    )
    with DistributedContext(config) as ctx:
        if pass_rank:
            return fn(ctx.rank, ctx.world_size, *args, **kwargs)
        return fn(*args, **kwargs)


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}.")


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    backend: str,
    timeout: float | timedelta | None,
    deadline: float | None,
    pass_rank: bool,
) -> list[Any]:
    _check_world_size(world_size)
    resolved = resolve_launch_backend(backend, world_size)
    if timeout is None:
        delta = DistributedConfig().timeout
    else:
        delta = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    task = functools.partial(_run_rank, fn, args, kwargs, resolved, delta, pass_rank)
    name = getattr(fn, "__qualname__", repr(fn))
    return run_in_processes(
        task,
        world_size,
        what=f"launch({name})",
        unit="rank",
        env=functools.partial(_child_env, world_size),
        deadline=deadline,
    )


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float | timedelta | None = None,
    deadline: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new local processes in one process group.

    Inside ``fn`` the group is initialised (``get_rank()``, ``DistributedContext()``, DDP all
    work). Returns the per-rank return values, by rank. ``fn`` may be a lambda, a closure or a
    function defined in ``__main__`` or a notebook (it travels with cloudpickle; so must its
    arguments and result).

    Args:
        backend: 'auto' (nccl on GPUs, else gloo), 'gloo' or 'nccl'.
        timeout: the process group's collective timeout (seconds or timedelta; default 60 min).
        deadline: seconds after which a run that has not finished is killed and
            ``WorkerTimeoutError`` names the ranks still running,
            with their stacks.

    Raises ``RankFailedError`` when a rank raises or dies (killed,
    segfault, ``os._exit``): the others are terminated within seconds, and the error names the
    failing rank with its original traceback (its exception chained as ``__cause__`` when it can
    be pickled). ``backend='nccl'`` without CUDA is a ConfigError suggesting gloo.
    """
    return _launch(
        fn,
        world_size,
        args,
        kwargs,
        backend=backend,
        timeout=timeout,
        deadline=deadline,
        pass_rank=False,
    )


def launch_distributed_training(
    train_fn: Callable[..., Any], world_size: int, backend: str = "auto", **kwargs: Any
) -> list[Any]:
    """Seed 003: call ``train_fn(rank, world_size, **kwargs)`` on ``world_size`` processes.

    Same machinery and errors as ``launch``; returns the per-rank return values.
    """
    return _launch(
        train_fn,
        world_size,
        (),
        kwargs,
        backend=backend,
        timeout=None,
        deadline=None,
        pass_rank=True,
    )


__all__ = ["launch", "launch_distributed_training", "resolve_launch_backend"]
