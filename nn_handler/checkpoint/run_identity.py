"""Which run a checkpoint belongs to: an id per run (kept on resume) and a fingerprint of what a
resume may not change (docs/checkpoints.md, "Checkpoints belong to a run").
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from nn_handler.errors import CheckpointError

#: The top-level entry of a checkpoint holding {"id": ..., "fingerprint": {...}}.
RUN = "run"

#: The hyperparameters that define a run (``Trainer.hyperparameters()`` keys).
IDENTITY = (
    "optimizer",
    "lr",
    "precision",
    "ema.enabled",
    "ema.decay",
    "ema.warmup",
    "ema.update_every",
    "ema.start_step",
    "ema.buffers",
    "loader.shuffle",
    "loader.seed",
    "loader.drop_last",
    "trainer.accumulate_grad_batches",
    "trainer.gradient_clip_val",
    "trainer.gradient_clip_algorithm",
    "trainer.gradient_clip_norm_type",
    "trainer.scheduler_interval",
    "trainer.nonfinite",
    "trainer.sync_batchnorm",
    "trainer.reproducible.global_batch_size",
    "trainer.reproducible.micro_batch_size",
    "trainer.reproducible.seed",
    "trainer.reproducible.reduction",
)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def fingerprint(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The run-defining subset of ``hyperparameters``, as plain values."""
    return {key: _plain(hyperparameters[key]) for key in IDENTITY if key in hyperparameters}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each field on which two fingerprints differ, as ``field: X in the checkpoint, Y in
    this run``; fields only one of them has are not compared (another nn_handler version)."""
    return [
        f"{key}: {saved[key]!r} in the checkpoint, {current[key]!r} in this run"
        for key in IDENTITY
        if key in saved and key in current and saved[key] != current[key]
    ]


def field_differences(
    first: Mapping[str, Any], second: Mapping[str, Any], where: tuple[str, str], prefix: str = ""
) -> list[str]:
    """Each key on which two sets of settings differ, as ``<prefix>key: X <where[0]>, Y
    <where[1]>`` (a key one lacks reads None there), in key order."""
    return [
        f"{prefix}{key}: {first.get(key)!r} {where[0]}, {second.get(key)!r} {where[1]}"
        for key in sorted(set(first) | set(second))
        if first.get(key) != second.get(key)
    ]


def run_of(checkpoint: Any) -> tuple[str | None, dict[str, Any]]:
    """A checkpoint's run id and fingerprint (None and {} for one written before runs had
    identities)."""
    run = checkpoint.get(RUN) if isinstance(checkpoint, Mapping) else None
    if not isinstance(run, Mapping):
        return None, {}
    found = run.get("fingerprint")
    return (str(run["id"]) if run.get("id") else None), dict(found) if isinstance(
        found, Mapping
    ) else {}


def run_to_continue(
    checkpoint: Any, current: Mapping[str, Any], source: str, refuse: bool
) -> tuple[str | None, str | None]:
    """The run id of ``checkpoint`` (``source``) to continue, and the warning to give when
    its run configuration differs from this run's fingerprint ``current`` (None: the same);
    a CheckpointError instead when it differs and ``refuse`` (an automatic resume)."""
    saved_run, saved = run_of(checkpoint)
    found = differences(saved, current)
    if not found:
        return saved_run, None
    if refuse:
        raise CheckpointError(refusal(source, found))
    return saved_run, (
        f"{source} was written by another run configuration ({'; '.join(found)}); continuing "
        f"its state with this run's settings"
    )


def refusal(source: str, found: list[str]) -> str:
    """Why an automatic resume of ``source`` (another run configuration) is refused."""
    return (
        f"{source} was written by another run configuration: {'; '.join(found)}. Resuming it "
        f"would continue that experiment's state with this one's settings. Use another "
        f"checkpoint.dir for this run, restore the settings to continue that run, or set "
        f"checkpoint.resume='force' to continue it anyway."
    )


__all__ = [
    "IDENTITY",
    "RUN",
    "differences",
    "field_differences",
    "fingerprint",
    "new_run_id",
    "refusal",
    "run_of",
    "run_to_continue",
]
