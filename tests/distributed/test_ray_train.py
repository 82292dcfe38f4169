"""Ray Train on a real local Ray cluster (2 CPUs, started once for the module, the suite's only
one), gloo on 127.0.0.1: NNHandler trains unchanged inside TorchTrainer's workers,
RayTrainReport reports committed checkpoints, a killed worker's group is restarted by Ray and
resumes from Ray's checkpoint bit for bit, a worker's error reaches the driver with its rank
and traceback, and examples/ray_train.py trains on the cluster.

Ray puts its processes, and the process group's MASTER_ADDR, on the node's address; with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (tests/conftest.py sets it for the session, before
Ray is imported) that address is the loopback one, which the cluster fixture checks before
any group is made.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_command, torchrun_command
from tests.interpreters import python_path
from tests.resume_helpers import TIMING_KEYS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "ray_helpers.py"
EXAMPLE = ROOT / "examples" / "ray_train.py"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster (2 CPUs, on the loopback address) for the module's tests and the
    Ray example (the suite's only one: starting one costs about 10 s of both cores)."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": python_path(ROOT), "OMP_NUM_THREADS": "1"}},
    )
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        ray.shutdown()


def fit(
    tmp: Path,
    name: str,
    fault: dict[str, Any] | None = None,
    *,
    workers: int = 2,
    restarts: int | None = None,
    reproducible: bool = False,
    run: str | None = None,
    loop: str = "train_loop",
    attempt: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """TorchTrainer over ``workers`` CPU workers running tests/ray_helpers.py's ``loop``
    (Ray restarts the group once when there is a fault, unless ``restarts`` says otherwise),
    as Ray run ``run`` (default ``name``: a run already in storage is continued from its latest
    checkpoint). Returns (Ray's Result, what rank 0 saved)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tests import ray_helpers

    here = tmp / name
    here.mkdir()
    settings: dict[str, Any] = {"dir": str(here / "local"), "out": str(here / "out")}
    settings.update(reproducible=reproducible, foreign=str(tmp / "foreign"))
    if fault is not None:
        settings["fault"] = {**fault, "marker": str(here / "fault-done")}
    if restarts is None:
        restarts = 1 if fault else 0
    trainer = TorchTrainer(
        getattr(ray_helpers, loop),
        train_loop_config=settings,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(tmp / "storage"),
            name=run or name,
            failure_config=FailureConfig(max_failures=restarts),
        ),
    )
    try:
        result = trainer.fit()
    except SystemError as error:  # Ray's own driver, not the run: see _ray_internal_error
        if attempt > 0 or not _ray_internal_error(error):
            raise
        warnings.warn(f"Ray failed in its own deserialization ({error}); once more", stacklevel=2)
        return fit(tmp, f"{name}-again", fault, workers=workers, restarts=restarts,
                   reproducible=reproducible, run=run and f"{run}-again", loop=loop,
                   attempt=1)  # fmt: skip
    return result, torch.load(settings["out"], weights_only=True)


def _ray_internal_error(error: SystemError) -> bool:
    """Ray 2.60's driver once failed to read back one of its own objects in a loaded
    fresh-clone run (``SystemError: <built-in method __new__ of type object> returned a
    result with an exception set``, raised in ``ray._raylet.SerializedRayObject`` for an
    object with ``XLANG`` metadata, before any worker's result was read): a fault of Ray's
    C extension, not of the run, which the next fit did not meet. Any other error (the
    run's, or Ray's reports of it) fails the test at once."""
    frames = traceback.extract_tb(error.__traceback__)
    return "returned a result with an exception set" in str(error) and any(
        "/ray/" in frame.filename for frame in frames
    )


def without_timings(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same train_loop under torchrun, 2 ranks: the reference run."""
    tmp = tmp_path_factory.mktemp("torchrun")
    settings = {"dir": str(tmp / "local"), "out": str(tmp / "out.pt")}
    env = {**os.environ, "PYTHONPATH": python_path(ROOT), "OMP_NUM_THREADS": "1"}
    code, output = run_command(
        torchrun_command(HELPERS, json.dumps(settings)), timeout=180, env=env
    )
    assert code == 0, output
    saved: dict[str, Any] = torch.load(settings["out"], weights_only=True)
    return saved


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return fit(tmp_path_factory.mktemp("ray"), "plain")


# This test's setup holds three runs, each bounded on its own (the torchrun reference by
# run_command, Ray's workers by HANG_BOUND_S): the reference first, before the cluster's
# processes share the cores, then the cluster's start and the Ray fit. The module's bound was
# too short for the three in a loaded CI run (> 331 s; 50 s on a quiet machine).
@pytest.mark.timeout(600)
def test_ray_train_gives_the_same_history_and_weights_as_torchrun(
    under_torchrun: dict[str, Any], uninterrupted: Any
) -> None:
    result, saved = uninterrupted
    assert len(saved["history"]) == 3
    assert without_timings(saved["history"]) == without_timings(under_torchrun["history"])
    for key, value in under_torchrun["weights"].items():
        assert torch.equal(saved["weights"][key], value), key
    # Every committed checkpoint reached Ray: the last one is the fit's end (3 epochs x 5
    # steps), with its metrics; in it, the nn_handler checkpoint of step 15.
    assert result.metrics["global_step"] == 15 and result.metrics["epoch"] == 3
    assert result.metrics["train_loss"] == saved["history"][-1]["train_loss"]
    assert [p.name for p in Path(result.checkpoint.path).iterdir()] == ["ckpt-e0003-s00000015.pt"]
    # Each checkpoint nn_handler committed (every 2 steps, and each epoch's end; at step 10
    # both the step's and epoch 2's), one per report, in order (named by epochs done).
    reported = [
        entry.name
        for checkpoint, _ in result.best_checkpoints
        for entry in Path(checkpoint.path).iterdir()
    ]
    done_steps = [(0, 2), (0, 4), (1, 5), (1, 6), (1, 8), (1, 10), (2, 10), (2, 12), (2, 14)]
    expected = [f"ckpt-e{e:04d}-s{s:08d}.pt" for e, s in [*done_steps, (3, 15)]]
    assert reported == expected


def test_a_killed_worker_is_restarted_by_ray_and_the_run_ends_bit_identical(
    ray_cluster: Any, tmp_path: Path, uninterrupted: Any
) -> None:
    # SIGKILL rank 1 after step 7 (mid-epoch 2; the last checkpoints: step 6, or 5 when Ray
    # had not registered step 6's report yet).
    result, saved = fit(tmp_path, "killed", {"step": 7, "rank": 1, "kind": "kill"})
    assert (tmp_path / "killed" / "fault-done").is_file()  # the kill happened
    _, reference = uninterrupted
    assert without_timings(saved["history"]) == without_timings(reference["history"])
    for key, value in reference["weights"].items():
        assert torch.equal(saved["weights"][key], value), key
    assert result.metrics["global_step"] == 15


@pytest.fixture(scope="module")
def failed_on_two(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-worker run in the reproducible mode whose rank 1 raises after step 7 of 12, with no
    restart left: (its folder, the driver's error). Two tests read it: the error's text, and
    the same run continued on one worker."""
    from ray.train import TrainingFailedError

    tmp = tmp_path_factory.mktemp("failed")
    with pytest.raises(TrainingFailedError) as caught:
        fit(tmp, "two", {"step": 7, "rank": 1, "kind": "raise"}, restarts=0, reproducible=True)
    return tmp, str(caught.value)


def test_an_error_on_one_worker_reaches_the_driver_with_its_rank_and_traceback(
    failed_on_two: tuple[Path, str],
) -> None:
    _, text = failed_on_two
    assert "Rank 1" in text, text
    assert "ValueError: a bad batch on rank 1 at step 7" in text, text
    assert "ray_helpers.py" in text and "after_optimizer_step" in text, text  # its traceback


def test_a_group_restarted_with_fewer_workers_ends_bit_identical_in_the_reproducible_mode(
    failed_on_two: tuple[Path, str],
) -> None:
    """What Ray's elastic mode does after losing a node: the run goes on with fewer workers
    from Ray's latest checkpoint. Here: 2 workers, rank 1 failed after step 7 of 12 with no
    restart left; the same Ray run started again on 1 worker (Ray hands it the run's latest
    checkpoint, as to a restarted elastic group of 1) ends with the digest of an
    uninterrupted single-process run. (A worker killed outright, the other way to lose one,
    is the test of Ray's own restart above.)"""
    from tests.reproducible_helpers import digest, handler, train

    tmp_path, _ = failed_on_two
    result, saved = fit(tmp_path, "one", workers=1, reproducible=True, run="two")
    assert saved["world_size"] == 1
    assert result.metrics["global_step"] == 12
    # With the workers' one thread (ray_helpers): the bits depend on the threads per process
    # (docs/reproducible.md), and pytest's own may have several.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with handler("cnn", None, folder=tmp_path / "alone") as alone:
            train(alone, "cnn")
            assert saved["digest"] == digest(alone)
    finally:
        torch.set_num_threads(threads)


def test_a_ray_checkpoint_that_is_not_nn_handlers_is_refused_by_name(
    ray_cluster: Any, tmp_path: Path
) -> None:
    from ray.train import TrainingFailedError

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "model.pt").write_bytes(b"not ours")
    # One fit: its first start reports the foreign checkpoint and fails; Ray restarts the
    # group with that checkpoint, and nn_handler's resume refuses it.
    with pytest.raises(TrainingFailedError) as caught:
        fit(tmp_path, "refused", workers=1, restarts=1, loop="report_foreign")
    text = str(caught.value)
    assert "should hold one nn_handler checkpoint (ckpt-e*-s*[.pt]) but holds ['model.pt']" in text
    assert "stopped after reporting" not in text  # the restart's error, not the first start's


def test_ray_train_example_trains_on_a_ray_cluster(tmp_path: Path, ray_cluster: Any) -> None:
    """examples/ray_train.py as docs/launching.md runs it on a running cluster (``--address``):
    the module's, which the example shares instead of starting its own."""
    address = ray_cluster.get_runtime_context().gcs_address
    command = [sys.executable, str(EXAMPLE), "--storage", str(tmp_path)]
    code, output = run_command([*command, "--address", address], timeout=300)
    assert code == 0, output
    # The example's stdout and Ray's log lines share one pipe: a Ray line written in two
    # pieces can end up in front of the example's line, so it is found anywhere in a line.
    finals = [line[line.index("final: ") :] for line in output.splitlines() if "final: " in line]
    assert len(finals) == 1, output
    assert float(finals[0].split("val_accuracy=")[1].split()[0]) >= 0.95, output
    assert "after 6 epochs" in finals[0], output
    # Each epoch's line once (rank 0's); of the six checkpoints reported, Ray kept the best
    # two by val_accuracy and the latest (which it always keeps, to restore from).
    for epoch in range(1, 7):
        assert sum(f"epoch {epoch}/6:" in line for line in output.splitlines()) == 1, output
    kept = [p.name for p in (tmp_path / "digits").glob("checkpoint_2*/ckpt-e*-s*.pt")]
    assert len(kept) == 3 and "ckpt-e0006-s00000138.pt" in kept, kept
