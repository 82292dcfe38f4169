"""Shared fixtures: every test starts and ends without process groups or a local group."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from loguru import logger

from nn_handler.distributed.local_groups import LOCAL_GROUPS
from tests.interpreters import python_path
from tests.timeouts import SCALE, scaled

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Ray's processes, and so the gloo group of its workers, stay on 127.0.0.1; reports are drained
#: every 0.2 s instead of 2 s; no usage stats. Ray reads these when it is imported, which any
#: test of the session may do first (tests/distributed/test_ray_train.py starts the cluster).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    # Every interpreter the tests start exits without the garbage collector's last walks
    # (tests/fast_exit/sitecustomize.py); a test that sets PYTHONPATH uses python_path too.
    os.environ["PYTHONPATH"] = python_path(*os.environ.get("PYTHONPATH", "").split(os.pathsep))


#: The files that take longest (worker-seconds in `make test`, tests/README.md), in that order:
#: they are collected first, so that pytest-xdist (which keeps a file on one worker and hands
#: files out in collection order, `--no-loadscope-reorder`) starts them first and the short
#: files fill the end (longest processing time first). Started last, the Ray file (about 270
#: worker-seconds) was the session's tail, one core idle for its last minute.
LONGEST_FIRST = (
    "launched/test_examples.py",
    "distributed/test_ray_train.py",
    "distributed/test_fault_tolerance.py",
    "distributed/test_step_fault_tolerance.py",
    "launched/test_benchmarks.py",
    "distributed/test_launcher.py",
    "distributed/test_large_model_memory.py",
    "unit/test_object_store_checkpoints.py",
    "launched/test_upload_kills.py",
    "launched/test_readme.py",
    "launched/test_demo.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = item.path.as_posix()
    return next(
        (i for i, name in enumerate(LONGEST_FIRST) if path.endswith("/tests/" + name)),
        len(LONGEST_FIRST),
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FIRST``; the others keep their order). pytest-timeout's
    bound of every test (its marker's, else the ini's) scaled for this machine's load
    (tests/timeouts.py): a hang still fails, slowness does not."""
    items.sort(key=_longest_first)  # stable
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else default
        if seconds > 0 and SCALE > 1:
            item.add_marker(pytest.mark.timeout(scaled(seconds)), append=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, nn_handler, every test module: about 500,000 objects)
    lives as long as the session: freeze it out of the garbage collector's reach, so that
    each full collection walks only what the tests made (one process running tests/unit made
    47 full collections, 24.6 s of its 144 s, before)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_log_sink_left() -> Iterator[None]:
    """A handler a test did not close keeps its log sink (as in a script): release it, so the
    next test starts with nn_handler silent and loguru's default sink in place."""
    yield
    from nn_handler import log

    for handle in list(log._LEASE.handles):
        log.disable_logging(handle)


@pytest.fixture(autouse=True)
def _clean_distributed_state() -> Iterator[None]:
    LOCAL_GROUPS.clear()
    yield
    LOCAL_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


DISTRIBUTED_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_ID",
    "NN_HANDLER_DEBUG_COLLECTIVES",
)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start in a clean single-process environment whatever the shell exported."""
    for name in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def lines() -> Iterator[list[str]]:
    """The library's log messages at INFO and above, one string per line, while the test runs
    (the library's lines are off unless logging is enabled)."""
    seen: list[str] = []
    logger.enable("nn_handler")
    handle = logger.add(
        lambda m: seen.append(str(m).rstrip("\n")), level="INFO", format="{message}"
    )
    yield seen
    logger.remove(handle)
    logger.disable("nn_handler")
