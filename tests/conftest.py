"""Shared fixtures: every test starts and ends without process groups or a local group."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from loguru import logger

from nn_handler.distributed.local_groups import LOCAL_GROUPS
from tests.timeouts import SCALE, scaled

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Ray's processes, and so the gloo group of its workers, stay on 127.0.0.1; reports are drained
#: every 0.2 s instead of 2 s; no usage stats. Ray reads these when it is imported, which any
#: test in a worker may do first: they are set for the whole session (make test's only Ray).
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_USAGE_STATS_ENABLED": "0",
}
#: The tests that use the session's Ray cluster run on one worker, one after the other.
ray_tests = pytest.mark.xdist_group("ray")


def pytest_configure(config: pytest.Config) -> None:
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's bound of every test (its marker's, else the ini's) scaled for this
    machine's load (tests/timeouts.py): a hang still fails, slowness does not.

    Under ``pytest -n N --dist loadgroup`` (make test) a file's tests stay on one worker, so
    its module fixtures (one process group serving many checks) run once; a file marked
    ``spread`` (tests that share nothing) is dealt out test by test; an explicit
    ``xdist_group`` (Ray's tests: one cluster per session) wins."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker is not None and marker.args else default
        if seconds > 0 and SCALE > 1:
            item.add_marker(pytest.mark.timeout(scaled(seconds)), append=False)
        if item.get_closest_marker("xdist_group") is None and not item.get_closest_marker("spread"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


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


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster (2 CPUs, on the loopback address) for the session's Ray tests
    (marked ``ray_tests``): starting one costs about 10 s of both cores."""
    import ray

    root = Path(__file__).resolve().parents[1]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}},
    )
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        ray.shutdown()
