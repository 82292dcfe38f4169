"""Run a function on several devices at once, one process per device (seed 002's executors).

``ParallelExecutor(num_gpus).run(func, *args, **kwargs)`` starts one worker process per device,
calls ``func`` there with the device (as the keyword argument ``device``, or as the first
positional argument when ``func``'s first parameter is named ``device``, as in the seed's
``def heavy_computation(device, data)``), and returns the results in device order. Functions
defined interactively work (cloudpickle); so must their arguments and results be picklable.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from nn_handler.distributed.processes import run_in_processes
from nn_handler.errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")


def select_devices(
    num_gpus: int | None = None, devices: Sequence[str | torch.device] | None = None
) -> list[torch.device]:
    """The devices to run on: ``devices`` when given, else the first ``num_gpus`` CUDA devices
    (all when None). Without CUDA and ``num_gpus=None``: the CPU, with a warning."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is not None:
        chosen = [torch.device(d) for d in devices]
        if not chosen:
            raise ConfigError("devices must name at least one device.")
        if num_gpus is not None and num_gpus != len(chosen):
            raise ConfigError(f"num_gpus={num_gpus} disagrees with {len(chosen)} devices given.")
        for device in chosen:
            if device.type == "cuda" and (device.index or 0) >= count:
                raise ConfigError(f"device {device} does not exist: {count} CUDA device(s).")
        return chosen
    if num_gpus is None:
        if count == 0:
            warnings.warn(
                "no CUDA device is available; running the function once on the CPU.",
                RuntimeWarning,
                stacklevel=3,
            )
            return [torch.device("cpu")]
        return [torch.device("cuda", i) for i in range(count)]
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError(f"num_gpus must be a positive int or None, got {num_gpus!r}.")
    if num_gpus > count:
        raise ConfigError(
            f"num_gpus={num_gpus} but {count} CUDA device(s) are available. Ask for at most "
            f"{count}, or pass devices=['cpu', 'cpu', ...] to run worker processes on the CPU."
        )
    return [torch.device("cuda", i) for i in range(num_gpus)]


def _device_is_first_parameter(func: Callable[..., Any]) -> bool | None:
    """True/False when ``func`` takes ``device`` first / elsewhere; None when it cannot."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False  # no signature to read: pass it by keyword
    names = [p.name for p in parameters]
    if names and names[0] == "device":
        return True
    if "device" in names or any(p.kind is p.VAR_KEYWORD for p in parameters):
        return False
    return None


def _run_on_device(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: list[torch.device],
    pass_device: bool,
    device_first: bool,
    index: int,
) -> Any:
    device = devices[index]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not pass_device:
        return func(*args, **kwargs)
    if device_first:
        return func(device, *args, **kwargs)
    return func(*args, device=device, **kwargs)


class ParallelExecutor:
    """Execute a function on several devices in parallel, one worker process per device.

    Args:
        num_gpus: how many CUDA devices to use (None: all; without CUDA, the CPU once, with a
            warning). More than are available is a ConfigError naming the count.
        pass_device: pass each worker its device as ``device``.
        devices: explicit devices instead, e.g. ``["cpu", "cpu"]`` or ``["cuda:0", "cuda:2"]``.
        timeout: seconds after which a run still going is killed and
            ``WorkerTimeoutError`` names the devices still running.

    ``run`` raises ``WorkerFailedError`` naming the device index and
    the original traceback when a worker raises or is killed. Each worker finds its index in
    the environment variable ``NN_HANDLER_WORKER_INDEX``.
    """

    def __init__(
        self,
        num_gpus: int | None = None,
        pass_device: bool = True,
        *,
        devices: Sequence[str | torch.device] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.devices = select_devices(num_gpus, devices)
        self.pass_device = pass_device
        self.timeout = timeout

    def __enter__(self) -> ParallelExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None  # workers live only during run(); nothing to release

    def run(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """Call ``func`` on every device in parallel; the results in device order."""
        device_first = _device_is_first_parameter(func) if self.pass_device else False
        if device_first is None:
            raise ConfigError(
                f"{getattr(func, '__qualname__', func)} takes no 'device' parameter but "
                f"pass_device=True; add a 'device' parameter or pass pass_device=False."
            )
        task = functools.partial(
            _run_on_device, func, args, kwargs, self.devices, self.pass_device, device_first
        )
        threads = str(max(1, (os.cpu_count() or 1) // len(self.devices)))
        names = ", ".join(str(d) for d in self.devices)
        results: list[R] = run_in_processes(
            task,
            len(self.devices),
            what=f"ParallelExecutor.run({getattr(func, '__qualname__', func)}) on [{names}]",
            unit="device",
            env=lambda index, workdir: {
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)
            },
            deadline=self.timeout,
        )
        return results


def parallelize_on_gpus(
    num_gpus: int | None = None, pass_device: bool = True
) -> Callable[[Callable[..., R]], Callable[..., list[R]]]:
    """Decorator: calling the function runs it on ``num_gpus`` devices (all when None) in
    parallel via ``ParallelExecutor`` and returns the list of results, in device order."""

    def decorate(func: Callable[..., R]) -> Callable[..., list[R]]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> list[R]:
            return ParallelExecutor(num_gpus, pass_device).run(func, *args, **kwargs)

        return wrapper

    return decorate


class _FunctionModule(nn.Module):
    def __init__(self, func: Callable[..., Any]) -> None:
        super().__init__()
        self.func = func

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def parallel_on_all_devices(func: Callable[P, R]) -> Callable[P, R]:
    """Decorator: run ``func`` through torch.nn.DataParallel on every visible CUDA device
    (inputs scattered along dim 0 from cuda:0, outputs gathered on cuda:0). Without CUDA the
    function is simply called."""
    module = _FunctionModule(func)

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.cuda.is_available():
            return func(*args, **kwargs)
        result: R = nn.DataParallel(module)(*args, **kwargs)
        return result

    return wrapper


__all__ = ["ParallelExecutor", "parallel_on_all_devices", "parallelize_on_gpus", "select_devices"]
