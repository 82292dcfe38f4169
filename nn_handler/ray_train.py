"""Ray Train: the same training script inside ``TorchTrainer``, with Ray's restarts and storage.

Inside a Ray Train worker ``NNHandler`` needs nothing from this module: Ray has already called
``init_process_group`` and set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, and
the context adopts that group. ``RayTrainReport`` (install ``nn_handler[ray]``) is the bridge
for checkpoints::

    handler = NNHandler(model, optimizer, loss, config=config, hooks=[RayTrainReport()])

- every periodic checkpoint, once committed, is reported with ``ray.train.report`` (rank 0
  passes the checkpoint, the others only the metrics; Ray copies it to
  ``RunConfig(storage_path=...)``);
- when Ray restarts the worker group, the first fit resumes from ``ray.train.get_checkpoint()``
  (the loop position included, so every batch is still trained exactly once);
- at each epoch's end without a checkpoint, the epoch's metrics alone are reported.

Retention has one owner, Ray (``ray.train.CheckpointConfig(num_to_keep=K)`` in its RunConfig):
Ray resumes from and returns (``Result.checkpoint``, ``best_checkpoints``) the checkpoints it
registered, so nothing else may delete them. ``checkpoint.dir`` is each worker's local staging
folder, where ``keep_last`` (default 1) rotates the local copies as usual.

Outside a Ray Train worker the hook does nothing, so one script runs under torchrun and Ray.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.format import kind_of
from nn_handler.checkpoint.naming import PERIODIC
from nn_handler.checkpoint.store.files import TMP_MARKER, atomic_link
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.hooks import Hook


def in_ray_train_worker() -> bool:
    """True inside a function Ray Train runs (``TorchTrainer``'s ``train_loop_per_worker``).
    Never imports Ray when the process has not."""
    if "ray" not in sys.modules:
        return False
    try:
        import ray.train

        ray.train.get_context()
    except (ImportError, RuntimeError):
        return False
    return True


class RayTrainReport(Hook):
    """Reports each committed periodic checkpoint (and each epoch's metrics) to Ray Train, and
    resumes the first fit from Ray's latest checkpoint after a restart. Every rank must have
    it. A no-op outside a Ray Train worker."""

    collective = True  # every report is a barrier of Ray's: each rank makes the same ones
    order = 1001  # after the CheckpointHook, whose commits it reports

    def __init__(self) -> None:
        self._opened: contextlib.ExitStack | None = None
        self._reported_step: int | None = None

    @property
    def active(self) -> bool:
        """Whether this process is a Ray Train worker (asked each time: a hook made in the
        driver and shipped to the workers acts there)."""
        return in_ray_train_worker()

    # ----------------------------------------------------------------- resuming
    def checkpoint_to_resume(self) -> Path | None:
        """The nn_handler checkpoint inside ``ray.train.get_checkpoint()`` (None: Ray has
        none, this is the group's first start)."""
        if not self.active:
            return None
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        stack = contextlib.ExitStack()
        folder = Path(stack.enter_context(checkpoint.as_directory()))
        self._opened = stack
        found = [entry for entry in sorted(folder.iterdir()) if PERIODIC.match(entry.name)]
        if len(found) != 1:
            self.close()
            raise CheckpointError(
                f"Ray's checkpoint {checkpoint.path} should hold one nn_handler checkpoint "
                f"(ckpt-e*-s*[.pt]) but holds {sorted(e.name for e in folder.iterdir())}; "
                f"was it reported by RayTrainReport?"
            )
        return found[0]

    def close(self) -> None:
        """Give back the directory Ray lent for the resume (a download is deleted)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.close()

    def before_train(self) -> None:
        """Gives back Ray's checkpoint directory (the resume has read it); warns, at each fit,
        when no checkpoint folder is set: nothing reaches Ray and a restart starts afresh."""
        self.close()
        trainer = self.trainer
        if self.active and trainer.checkpointing.manager is None and trainer.is_main_process:
            trainer.log.warning(
                "RayTrainReport: no checkpoint folder, so no checkpoint reaches Ray and a group "
                "Ray restarts starts afresh; set checkpoint.dir (a local folder) to report them"
            )

    def after_train(self) -> None:
        self.close()

    # ----------------------------------------------------------------- reporting
    def checkpoint_committed(self, path: Path, epoch: int, step: int) -> None:
        """Report the committed checkpoint ``path`` with the latest metrics. Every rank."""
        if not self.active:
            return
        import ray.train

        metrics = self._metrics(epoch, step)
        if self.trainer.comm.rank != 0:
            ray.train.report(metrics, checkpoint=None)
        else:
            with report_folder(path) as folder:
                checkpoint = ray.train.Checkpoint.from_directory(str(folder))
                ray.train.report(metrics, checkpoint=checkpoint)
        self._reported_step = step

    def after_epoch(self) -> None:
        """The epoch's metrics, when no checkpoint was reported at its end."""
        state = self.trainer.state
        if not self.active or self._reported_step == state.global_step:
            return
        import ray.train

        ray.train.report(self._metrics(state.epoch, state.global_step), checkpoint=None)
        self._reported_step = state.global_step

    def _metrics(self, epoch: int, step: int) -> dict[str, Any]:
        """The latest epoch record, with ``epoch`` (epochs done) and ``global_step``."""
        history = self.trainer.history
        record = dict(history.last) if len(history) else {}
        return {**record, "epoch": epoch, "global_step": step}


@contextlib.contextmanager
def report_folder(path: Path) -> Iterator[Path]:
    """A folder holding only the checkpoint ``path`` (a file or a sharded folder), as hard
    links beside it (copies where links fail), removed afterwards."""
    folder = path.with_name(f".{path.name}{TMP_MARKER}ray")  # swept like other leftovers
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    try:
        if kind_of(path) in ("folder", "checkpoints"):  # a folder, committed or not
            shutil.copytree(path, folder / path.name, copy_function=atomic_link)
        elif path.is_file():
            atomic_link(path, folder / path.name)
        else:
            raise ConfigError(
                f"RayTrainReport reports local checkpoints, but {path} is not on this machine: "
                f"set checkpoint.dir to a local folder (Ray copies it to "
                f"RunConfig(storage_path=...), which may be an object store)."
            )
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["RayTrainReport", "in_ray_train_worker", "report_folder"]
