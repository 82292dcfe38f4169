"""FaultTolerantSteps: the reproducible mode's steps run among the members of a fault-tolerant
run (TrainerConfig.fault_tolerance). Each member is one process (world size 1 for its own
handler) that loads every micro-batch of a step and trains those it owns among the step's
members; the exact sum goes through the run (Replica). A step the run abandons is redone, from
the same state, by the members left, so the weights, optimizer state and History are the bits
of a run that never failed; the optimizer steps only once the step is committed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from loguru import logger
from torch import nn

from nn_handler.config.fault_tolerance import FaultToleranceConfig
from nn_handler.data.fixed_batches import MicroBatch, StepBatch, owns
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError, DistributedError, PeerLostError, RunFinished
from nn_handler.training.fault_tolerance.membership import (
    check_fingerprint,
    fingerprint_text,
    join_the_run,
    member_fingerprint,
)


class SummedStep(Protocol):
    """What the members' steps need of the step they run (the reproducible mode's ExactStep
    or FloatStep: fault tolerance sits beside that mode and imports nothing of it)."""

    #: The model the step trains (its buffers are put back when a step is abandoned).
    module: nn.Module
    #: The collectives of the step's sum: the members' communicator, once in the run.
    comm: Communicator

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class FaultTolerantSteps:
    """One member's part of the run ``config`` describes, for the reproducible mode's
    ``exact`` step. ``comm`` is this process's own (a member is one process)."""

    def __init__(self, config: FaultToleranceConfig, exact: SummedStep, comm: Communicator) -> None:
        if comm.world_size > 1:
            raise ConfigError(
                f"fault_tolerance: this process is rank {comm.rank} of {comm.world_size}; each "
                f"member of a fault-tolerant run is one process of its own (torchrun would "
                f"stop them all when one dies): start N processes with python (or "
                f"nn_handler.launch) and one Lighthouse (docs/fault-tolerance.md)."
            )
        self.config = config
        self.exact = exact
        self.member_id = config.member_name()
        self.replica: Any = None
        self._load: Callable[[Any], None] | None = None
        self._in_loop = self._behind = False
        self._emergency: Callable[[], object] | None = None
        self._leaving: Callable[[], bool] = lambda: False
        self._begun = False  # begin_fit agreed on the first step's members
        #: Whether this member writes the run's trackers: the first member of the last step
        #: agreed on (another takes over when it is lost; see Trainer.is_reporting_process).
        self.writes = False
        #: The run's id, the same on every member (agreed at begin_fit; None before).
        self.run_id: str | None = None
        #: Attempts abandoned and redone in this fit.
        self.redone = 0
        self._members = 0  # the members of the last step agreed on (0: none yet)
        self._abandoned: str | None = None  # why the last attempt was abandoned, not said yet
        # This member's part of the step's last abandoned attempt's sum (an exact step's):
        # the redo adds it instead of computing its micro-batches again.
        self._carried: Any = None
        if getattr(exact, "carries_sums", False):
            exact.keeps_unsent = True  # type: ignore[attr-defined]
        self.log = logger.bind(rank=0)

    def begin_fit(
        self,
        global_step: int,
        state: Callable[[], Any] = dict,
        load: Callable[[Any], None] | None = None,
        emergency: Callable[[], object] | None = None,
        own_run: Callable[[str | None], str] | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        leaving: Callable[[], bool] = lambda: False,
    ) -> None:
        """Join the run as this member, at ``global_step``, and agree on the first step's
        members. A member behind the run (one restarted, or new) receives ``state()`` of one
        that is not (the whole checkpoint: model, optimizer, loop position...) and gives it to
        ``load`` before its loop starts, which then continues where the run is. When the run
        cannot go on step by step (too few members, the Lighthouse gone), ``emergency`` saves
        this member's state, at its last committed step, before the error is raised.
        ``own_run(run_id)`` sets this member's run id and returns it (``None``: keep its own,
        from its checkpoint or the state it received): the members agree on one (the first
        to propose it), so that the trackers and checkpoints of every member name one run.
        ``fingerprint``: the run's (checkpoint/run_identity.py); a member whose settings
        differ from the run's is refused first, before any step (membership.py).
        ``leaving()``: whether this member stops after the step it votes on (a preemption it
        received): the run then agrees on its members before the next step."""
        from nn_handler.training.fault_tolerance.replica import Replica

        config = self.config
        self._load, self._in_loop, self._emergency = load, False, emergency
        self._leaving = leaving
        mine = member_fingerprint(fingerprint or {}, self.exact.module)
        join_the_run(
            self.member_id, mine, config.lighthouse, config.timeout_s, config.quorum_timeout_s
        )
        self.replica = replica = Replica(
            config.lighthouse,
            self.member_id,
            state_dict=state,
            load_state_dict=self._join,
            min_members=config.min_members,
            host=config.host,
            timeout_s=config.timeout_s,
            quorum_timeout_s=config.quorum_timeout_s,
            init_sync=False,  # every member builds the same model from the same seed
        )
        replica.manager.load_state_dict({"step": global_step, "batches_committed": 0})
        self.exact.comm = replica.communicator
        # The first step waits for the members that start together (not for a joiner).
        try:
            replica.begin_step(config.start_members)
        except RunFinished as finished:  # started after the run's end: one line, exit 0
            self.log.info("{}", finished)
            raise
        self._members = replica.members
        # Again with the run's members (the Lighthouse may have been restarted since, and a
        # restarted one learns the run's fingerprint from them): refused now, it leaves.
        agreed = replica.agree("fingerprint", fingerprint_text(mine))
        try:
            check_fingerprint(self.member_id, mine, agreed, config.lighthouse)
        except ConfigError:
            self.end_fit()
            raise
        if own_run is not None:
            self.run_id = own_run(replica.agree("run_id", own_run(None)))
        self.writes = replica.rank == 0
        self._begun = True

    @property
    def run_key(self) -> str | None:
        """The run's id (modes.base.Reporting: every member writes the trackers under it)."""
        return self.run_id

    def _join(self, state: Any) -> None:
        """The state of a member that is not behind, received (checked) at a step boundary."""
        if self._load is None or self._in_loop:
            self._behind = True
            raise DistributedError(
                f"member {self.member_id} is behind the run (it missed a committed step "
                f"while alive: slower than timeout_s, or left out by the Lighthouse's "
                f"join timeout); it stops. Restart it: a member that starts joins the run "
                f"where it is."
            )
        self._load(state)
        self.log.info(
            "member {} joined the run at step {}: the state of a member received and checked",
            self.member_id, self.replica.step if self.replica else "?",
        )  # fmt: skip

    def end_fit(self, completed: bool = False) -> None:
        """Leave the run (the others go on without this member); ``completed``: this
        member's fit ended with the run's last step committed, which the run then keeps (a
        member that starts after it leaves at once: RunFinished)."""
        if self.replica is None:
            return
        if completed:
            try:
                self.replica.finish()
            except DistributedError as error:  # the training is done: not a failure
                self.log.debug("the run's end could not be kept: {}", error)
        self.replica.close()
        self.replica = None

    def step(
        self, batch: StepBatch, run: Callable[[StepBatch], torch.Tensor], global_step: int
    ) -> torch.Tensor:
        """``run`` (the exact step) on this member's micro-batches of ``batch`` among the
        step's members, redone from the same state until the run commits it; returns its
        loss. Every member must call this for every step."""
        replica = self.replica
        if replica is None:
            raise DistributedError("fault_tolerance: a step before begin_fit.")
        # What a step changes before its commit: the scales, the BatchNorm statistics.
        scales = {k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in self.exact.state_dict().items()}  # fmt: skip
        buffers = [(b, b.clone()) for b in self.exact.module.buffers()]
        self._in_loop = True
        try:
            return self._committed(batch, run, global_step, scales, buffers)
        except DistributedError:  # the run cannot go on step by step: this member stops
            if self._abandoned is not None:
                self._say_the_members(self._members, global_step)
            self._put_back(scales, buffers)
            if self._emergency is not None and not self._behind:
                self._save_emergency(self._emergency, global_step)
            raise

    def _committed(
        self,
        batch: StepBatch,
        run: Callable[[StepBatch], torch.Tensor],
        global_step: int,
        scales: dict[str, Any],
        buffers: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        replica = self.replica
        while True:
            if not self._begun:  # begin_fit's agreement is the first step's
                replica.next_attempt()
                self._say_the_members(replica.members, global_step)
            self._begun = False
            if replica.step != global_step:
                raise DistributedError(
                    f"member {self.member_id} is at step {global_step}, the run at step "
                    f"{replica.step}: every member must start from the same checkpoint."
                )
            rank, members = replica.rank, self.training_members(replica.members)
            loss: torch.Tensor | None = None
            lost: PeerLostError | None = None
            try:
                mine = self._share(batch, rank, members, global_step)
                loss = run(dataclasses.replace(batch, micro=mine))
            except PeerLostError as error:
                lost = error
            position = f"batch {batch.step + 1} of its epoch"
            if replica.commit(position, self._leaving()) and loss is not None:
                self.writes = rank == 0
                self._carried = None
                return loss
            self._carried = getattr(self.exact, "unsent", None)  # its sum, kept for the redo
            if (run_at := replica.run_position) != position:
                self._behind = True  # its position is not the run's: no emergency save
                raise DistributedError(
                    f"member {self.member_id} is at {position} of step {global_step + 1}, "
                    f"the run at {run_at}: its place in the data differs from the others'; "
                    f"it stops (restart it: it joins the run where it is)."
                )
            self.redone += 1
            self._put_back(scales, buffers)
            # Said once the next attempt's members are agreed (with their number if it changed).
            self._abandoned = str(lost or "a member failed it, or did not vote within timeout_s")

    def _share(
        self, batch: StepBatch, rank: int | None, members: int, global_step: int
    ) -> tuple[MicroBatch, ...]:
        """This member's micro-batches of the attempt: micro-batch ``j`` on member ``j %
        members``. In an attempt whose members were agreed (``Replica.agreed``: a redo of an
        abandoned attempt is one; the same on every member, a joiner's too) of an exact step,
        the members first sum which micro-batches each carries from an abandoned attempt of
        the step (one small collective, none in a step whose members were kept): only the
        others are dealt out, in order, and each member's carried sum goes into this
        attempt's (``ExactStep.carried``)."""
        trains = rank is not None and rank < members
        if not (self.replica.agreed and getattr(self.exact, "keeps_unsent", False)):
            return tuple(m for m in batch.micro if trains and owns(m.index, rank or 0, members))
        carried = self._carried
        exponents = self.exact.state_dict().get("exponents")
        if carried is not None and not carried.fits(global_step, exponents):
            carried = None
        where = {m.index: k for k, m in enumerate(batch.micro)}
        held = torch.zeros(len(batch.micro), dtype=torch.int64)
        for index in carried.indices() if carried is not None else ():
            held[where[index]] = 1
        self.replica.communicator.all_reduce_(held, "sum")
        # (held is the host's: the members' group sums CPU tensors; a redo's, not a step's)
        if bool((held > 1).any()):  # a micro-batch carried twice: no carried sum is used
            held.zero_()
            carried = None
        setattr(self.exact, "carried", carried)  # noqa: B010 (ExactStep's, not SummedStep's)
        left = [m for k, m in enumerate(batch.micro) if held[k] == 0]
        return tuple(m for k, m in enumerate(left) if trains and owns(k, rank or 0, members))

    def _say_the_members(self, members: int, global_step: int) -> None:
        """One line when an attempt was abandoned (its cause, and the members left if their
        number changed), or when the run's members change between two steps (a member that
        joined, or one that left announcing it: a preempted one)."""
        before, self._members = self._members, members
        if self._abandoned is not None:
            why, self._abandoned = self._abandoned, None
            change = f" ({members} member(s) now, {before} before)" if members != before else ""
            self.log.warning(
                "step {}: abandoned by the run ({}); redone by the members left{}",
                global_step + 1, why, change,
            )  # fmt: skip
            return
        if before and members != before:
            change = "a member left the run" if members < before else "a member joined the run"
            if abs(members - before) > 1:
                change = "members left the run" if members < before else "members joined the run"
            self.log.info(
                "step {}: {} ({} member(s) now, {} before)",
                global_step + 1, change, members, before,
            )  # fmt: skip

    def training_members(self, members: int) -> int:
        """How many of a step's ``members`` train its micro-batches (ranks below it; the
        others are spares, at most ``max_members`` train)."""
        most = self.config.max_members
        return members if most is None else min(members, most)

    def _save_emergency(self, emergency: Callable[[], object], global_step: int) -> None:
        """This member's state at its last committed step, for a restart of the whole run (a
        failure to write it is said, and the run's own error raised)."""
        try:
            path = emergency()
        except Exception as error:  # the run's error is the one to raise
            self.log.error(
                "member {}: the emergency checkpoint of step {} could not be written ({}: {})",
                self.member_id, global_step, type(error).__name__, error,
            )  # fmt: skip
            return
        self.log.warning(
            "member {}: the run cannot go on step by step; emergency checkpoint of its {} "
            "committed steps: {}",
            self.member_id, global_step, path,
        )  # fmt: skip

    def _put_back(
        self, scales: dict[str, Any], buffers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """The state the step started from: the scales and the BatchNorm statistics (the
        optimizer steps only on a commit)."""
        self.exact.load_state_dict(scales)
        for buffer, value in buffers:
            buffer.copy_(value)


__all__ = ["FaultTolerantSteps", "SummedStep"]
