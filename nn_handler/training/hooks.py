"""Hooks: code that runs at fixed points of the loop, holding a weak reference to the trainer.

Subclass ``Hook`` and override what you need. The trainer calls only the methods a hook
overrides, so an unused point costs nothing in the hot path. ``after_train`` runs in
``finally``, also when training raised.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError, NNHandlerError

HOOK_POINTS = (
    "before_train",
    "after_train",
    "before_epoch",
    "after_train_epoch",
    "after_epoch",
    "before_step",
    "after_step",
    "after_optimizer_step",
    "after_validation",
    "after_log",
)


class Hook:
    """Base class of trainer hooks; every method is a no-op.

    - ``before_train`` / ``after_train``: once per ``fit`` (after_train also on error).
    - ``before_epoch`` / ``after_epoch``: around each epoch; ``trainer.history.last`` holds
      the finished epoch's record in after_epoch.
    - ``after_train_epoch``: after the epoch's training batches, before its validation;
      every rank reaches it together, so a hook may run a collective of its own there
      (every rank must); an error there stops every rank, like one in a training step.
    - ``before_step`` / ``after_step``: around each batch (``trainer.state`` tells which).
    - ``after_optimizer_step``: after each optimizer step (the last batch of an accumulation
      window), once ``trainer.state.global_step`` counts it.
    - ``after_validation(metrics)``: with the reduced validation metrics (same on every rank).
    - ``after_log(metrics, step)``: on rank 0 only, after the training code logged scalars
      with ``trainer.log_metrics`` (experiment trackers write them there).
    Hooks run on every rank; use ``trainer.is_main_process`` to act on rank 0 only
    (``trainer.is_reporting_process`` for what a run writes once, as the trackers do). They run
    in ascending ``order`` (default 0), then in the order given: monitors that complete the
    epoch record have a negative order, experiment loggers that log it a positive one.
    ``self.trainer`` is the Trainer the hook is attached to (typed ``Any`` so that this module
    does not import the Trainer; annotate ``trainer: MyTrainer = self.trainer`` for checks).
    """

    _trainer_ref: weakref.ReferenceType[Any] | None = None
    #: Where the hook runs among the others at each point (ascending; ties keep their order).
    order: int = 0
    #: True for a hook whose methods run collectives and raise only errors that every rank
    #: raises alike (the CheckpointHook): at the points whose errors the ranks agree on
    #: (before_train, before_epoch, after_epoch) it runs after that agreement, on every rank.
    collective: bool = False

    @property
    def trainer(self) -> Any:
        trainer = self.attached_trainer
        if trainer is None:
            raise NNHandlerError(f"{type(self).__name__} is not attached to a live Trainer.")
        return trainer

    @property
    def attached_trainer(self) -> Any | None:
        """The Trainer the hook is attached to, or None (not attached, or gone)."""
        return self._trainer_ref() if self._trainer_ref is not None else None

    def attach(self, trainer: Any) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def before_train(self) -> None:
        """Before the first epoch."""

    def after_train(self) -> None:
        """After the last epoch, or when training raised."""

    def before_epoch(self) -> None:
        """Before each epoch."""

    def after_train_epoch(self) -> None:
        """After the epoch's training batches, before its validation (collectives allowed)."""

    def after_epoch(self) -> None:
        """After each epoch, with its record in ``trainer.history``."""

    def before_step(self) -> None:
        """Before each batch."""

    def after_step(self) -> None:
        """After each batch (``trainer.state.last_loss`` is a device tensor: no host sync)."""

    def after_optimizer_step(self) -> None:
        """After each optimizer step (every rank alike, also a step skipped for NaN/inf)."""

    def after_validation(self, metrics: dict[str, float]) -> None:
        """After each validation run, with its reduced metrics."""

    def after_log(self, metrics: dict[str, float], step: int) -> None:
        """On the reporting process (rank 0), after ``trainer.log_metrics(metrics, step)``."""


class HookList:
    """The hooks of one trainer, indexed by the points each one overrides."""

    def __init__(self, hooks: Iterable[Hook], trainer: Any) -> None:
        given = list(hooks)
        for hook in given:
            if not isinstance(hook, Hook):
                raise ConfigError(
                    f"hooks must be nn_handler Hook instances, got {type(hook).__name__}; "
                    f"subclass nn_handler.training.Hook."
                )
            hook.attach(trainer)
        self.hooks = sorted(given, key=lambda hook: hook.order)
        self._by_point: dict[str, list[Hook]] = {
            point: [h for h in self.hooks if _overrides(h, point)] for point in HOOK_POINTS
        }

    def has(self, point: str) -> bool:
        return bool(self._by_point[point])

    def call(self, point: str, *args: Any, collective: bool | None = None) -> None:
        """Call ``point`` on every hook that overrides it, in order (only the ``collective``
        ones, or only the others, when given). ``after_train`` (the clean-up point: loggers
        finalize there) reaches every hook even when one raises; the first error is raised
        after the last hook ran."""
        hooks = self._by_point[point]
        if collective is not None:
            hooks = [hook for hook in hooks if hook.collective is collective]
        if point != "after_train":
            for hook in hooks:
                getattr(hook, point)(*args)
            return
        first: Exception | None = None
        for hook in hooks:
            try:
                getattr(hook, point)(*args)
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

    def call_after_train(self, failed: bool, log: Any) -> None:
        """The ``after_train`` point, in ``fit``'s ``finally``: an error there is raised when
        training succeeded, and logged (not raised over the training error) when it failed."""
        try:
            self.call("after_train")
        except Exception:
            if not failed:
                raise
            log.exception("an after_train hook raised while training was failing")

    def call_agreed(
        self,
        point: str,
        comm: Communicator,
        what: str = "",
        *,
        first: Callable[[], None] | None = None,
        share: Callable[[], Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Call ``point`` on the hooks that are not ``collective`` (``first()`` before them),
        then agree with every rank on whether that raised anywhere: a hook that raises on one
        rank raises RankFailedError on every rank instead of leaving the others waiting in
        their next collective (one tiny all_gather; ``Communicator.raise_if_any_failed``).
        ``share()``, a few integers read after the hooks, travels with it: returns every
        rank's. The caller then calls the collective hooks. Every rank must call this."""
        error: Exception | None = None
        try:
            if first is not None:
                first()
            self.call(point, collective=False)
        except Exception as caught:
            error = caught
        shared = share() if share is not None else ()
        return comm.raise_if_any_failed(error, what or f"{point} hooks", shared)


def _overrides(hook: Hook, point: str) -> bool:
    return getattr(type(hook), point) is not getattr(Hook, point)


__all__ = ["HOOK_POINTS", "Hook", "HookList"]
