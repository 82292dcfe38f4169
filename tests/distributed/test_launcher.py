"""launch and launch_distributed_training: real processes, every failure mode bounded."""

from __future__ import annotations

import functools
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nn_handler import launch, launch_distributed_training
from nn_handler.distributed import communicator, get_dist_info, get_rank, get_world_size
from nn_handler.distributed.processes import run_in_processes
from nn_handler.errors import ConfigError, DistributedError, RankFailedError, WorkerTimeoutError
from tests.harness import run_command
from tests.timeouts import scaled, scaled_now

pytestmark = pytest.mark.distributed
DEADLINE = scaled(60.0)  # every launch in this file bounds itself
#: How long a surviving rank sleeps after its peer failed: far past any start under load.
SURVIVOR_S = 120


def test_launch_returns_per_rank_results_of_a_closure_and_a_lambda() -> None:
    offset = 100  # captured by the closure: travels with cloudpickle

    def where(scale: int, *, shift: int) -> tuple[int, int, str, int, int]:
        info = get_dist_info()
        total = communicator().all_reduce(get_rank() + offset)
        return info.rank, info.world_size, dist.get_backend(), total, scale * shift

    assert launch(where, 2, 3, shift=2, deadline=DEADLINE) == [
        (0, 2, "gloo", 201, 6),
        (1, 2, "gloo", 201, 6),
    ]
    assert launch(lambda: get_world_size() * 10, 2, deadline=DEADLINE) == [20, 20]


def test_a_function_defined_in_main_without_a_guard_can_be_launched() -> None:
    script = textwrap.dedent(
        """
        from nn_handler import launch
        from nn_handler.distributed import get_rank

        def report(tag):
            return f"{tag}:{get_rank()}"

        print(launch(report, 2, "main", deadline=60))
        """
    )
    code, output = run_command([sys.executable, "-c", script], timeout=120)
    assert code == 0, output
    assert "['main:0', 'main:1']" in output


def _raise_on(rank_to_fail: int) -> None:
    if get_rank() == rank_to_fail:
        raise ValueError(f"bad shard on rank {rank_to_fail}")
    time.sleep(SURVIVOR_S)  # would keep the run alive far past the grace period


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_raises_fails_the_launch_fast_with_its_traceback(failing: int) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(_raise_on, 2, failing, deadline=DEADLINE)
    # Below the survivor's sleep whatever the machine's load: a terminated survivor. (Two
    # suites at once took 31.5 s at load 11 on 2 cores, most of it starting the interpreters.)
    bound = min(scaled_now(20), SURVIVOR_S - 10)
    assert time.monotonic() - start < bound, "the survivor must be terminated within seconds"
    error = info.value
    assert error.failed_ranks == [failing]
    assert isinstance(error.__cause__, ValueError)
    text = str(error)
    assert f"ValueError: bad shard on rank {failing}" in text and "in _raise_on" in text
    assert f"rank(s) [{1 - failing}] were terminated after the failure" in text


def _killed_or_exits(how: str) -> None:
    if get_rank() == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    communicator().barrier()  # rank 0 waits for a rank that is gone


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("sigkill", "killed by SIGKILL (exit code -9) without raising"),
        ("os_exit", "exited with code 3 without returning a result"),
    ],
)
def test_a_rank_that_dies_fails_the_launch_naming_it(how: str, expected: str) -> None:
    with pytest.raises(RankFailedError) as info:
        launch(_killed_or_exits, 2, how, deadline=DEADLINE)
    assert 1 in info.value.failed_ranks and expected in str(info.value)


def _hang() -> None:
    time.sleep(600)


def test_a_hang_is_turned_into_an_error_at_the_deadline_naming_the_ranks() -> None:
    with pytest.raises(WorkerTimeoutError) as info:
        # Room for a slow start (scaled by the load now, not only at the session's start):
        # the stacks must be in _hang. Two interpreters importing torch on a loaded 2-core
        # machine (3.9 s of CPU each) once took more than 15 s, and at 97247a8 more than
        # scaled(25) late in a fresh clone's run: both stacks were empty.
        launch(_hang, 2, deadline=scaled_now(25))
    assert info.value.running == [0, 1]
    assert "in _hang" in info.value.stacks[0] and "in _hang" in info.value.stacks[1]


def _train(rank: int, world_size: int, *, steps: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [round(p, 6) for p in torch.cat([p.flatten() for p in model.parameters()]).tolist()]


def test_launch_distributed_training_passes_rank_and_world_size_and_syncs_ddp() -> None:
    params = launch_distributed_training(_train, 2, backend="gloo", steps=5, lr=0.05)
    assert len(params) == 2 and params[0] == params[1], "DDP keeps replicas identical"


def test_bad_arguments_fail_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="world_size must be a positive int"):
        launch(_hang, 0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="backend='gloo'"):
            launch(_hang, 2, backend="nccl")


def _returns_a_foreign_object(folder: str, index: int) -> object:
    sys.path.insert(0, folder)  # only this worker can import the module
    import child_only_module  # type: ignore[import-not-found]

    return child_only_module.Thing()


def test_a_result_the_parent_cannot_unpickle_is_named(tmp_path: Path) -> None:
    (tmp_path / "child_only_module.py").write_text("class Thing:\n    pass\n")
    with pytest.raises(DistributedError, match="rank 0 returned a value this process cannot"):
        run_in_processes(
            functools.partial(_returns_a_foreign_object, str(tmp_path)), 1, what="foreign"
        )


class _Unloadable:
    """Pickles fine in the worker; raises when the parent unpickles it."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())


def _refuse_to_load() -> None:
    raise RuntimeError("this object cannot be rebuilt here")


def _returns_unloadable() -> Any:
    return _Unloadable()


@pytest.mark.distributed
def test_a_worker_result_that_cannot_be_unpickled_is_named() -> None:
    with pytest.raises(DistributedError, match=r"rank 0 returned a value .* cannot unpickle"):
        launch(_returns_unloadable, 2, backend="gloo")
