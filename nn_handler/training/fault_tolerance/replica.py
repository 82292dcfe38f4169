"""Replica: one member of a fault-tolerant run, over torchft's Manager. Each step:

    replica.begin_step()      # the step's members, agreed by the Lighthouse; a member that is
                              # behind (a new one) first receives the state of one that is not
    ... collectives through replica.communicator (ranks: replica.rank of replica.members)
    if replica.commit():      # every member finished the step: it counts, step it
        optimizer.step()
    else:                     # a member was lost: nothing changed; the same step is redone

A step is committed only if its collectives completed on every member of it, so what it summed
is the whole step's (every micro-batch of it, whoever computed them); the verdict, commit or
abort, is written once in the Lighthouse's store (the first one written stands) and read by
every member, so none commits a step that another abandons, even when a member dies in the
middle of a collective that completed on some. An abandoned step is redone with the same
micro-batches spread over the members left. Each member is its own torchft replica group of
one process (its own launcher), so a member's death is never its launcher's reason to kill
the others.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from nn_handler.errors import DistributedError, NNHandlerError
from nn_handler.training.fault_tolerance import engine
from nn_handler.training.fault_tolerance.communicator import ReplicaCommunicator
from nn_handler.training.fault_tolerance.engine import TCPStore
from nn_handler.training.fault_tolerance.lighthouse import agreed_value, verdicts_of


class Replica:
    """The member ``member_id`` of the run coordinated by the Lighthouse at ``lighthouse``.

    Args:
        state_dict: the whole state a new member receives (model, optimizer, loop position...).
        load_state_dict: takes that state in a new member.
        min_members: the fewest members a step may commit with.
        host: the address this member listens on and is reached at.
        timeout_s: the longest wait for a collective or a state transfer (a member silent
            that long is lost).
        quorum_timeout_s: the longest wait for a step's members to be agreed.
        init_sync: the members' first step gives every one the state of one of them (False:
            they start with the same state already).
    """

    def __init__(
        self,
        lighthouse: str,
        member_id: str,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        *,
        min_members: int = 1,
        host: str = "127.0.0.1",
        timeout_s: float = 5.0,
        quorum_timeout_s: float = 30.0,
        init_sync: bool = True,
    ) -> None:
        engine.require_torchft()
        from nn_handler.training.fault_tolerance.transport import VerifiedTransport

        self.member_id = member_id
        self.lighthouse = lighthouse
        self.min_members = min_members
        self.timeout_s = timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        timeout = timedelta(seconds=timeout_s)
        # The replica group's own store (a group of one process): torchft's Manager needs one.
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.group: Any = engine.member_group(timeout, self._first_undecided)
        self.manager: Any = engine.member_manager(
            host,
            pg=self.group,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_members,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=member_id,
            checkpoint_transport=VerifiedTransport(self.group, timeout),
            init_sync=init_sync,
        )
        self.communicator = ReplicaCommunicator(self)
        #: The collective failure of the step in flight (None: none).
        self.failure: BaseException | None = None
        self._verdicts = verdicts_of(lighthouse, timeout_s)
        # The step's attempt within its quorum (the members the Lighthouse agreed on): the
        # first whose verdict is not written yet (see _quorum_once).
        self._quorum = -1
        self._attempt = 0

    @property
    def store_port(self) -> int:
        """The port of this member's replica-group store (torch's TCPStore, which listens on
        every interface as torchrun's does)."""
        return int(self._store.port)

    @property
    def step(self) -> int:
        """The number of committed steps."""
        return int(self.manager.current_step())

    @property
    def rank(self) -> int | None:
        """This member's rank in the current step (None: it takes no part)."""
        rank = self.manager.participating_rank()
        return None if rank is None else int(rank)

    @property
    def members(self) -> int:
        """How many members the current step has."""
        return int(self.manager.num_participants())

    def begin_step(self, least: int | None = None) -> bool:
        """Agree on this step's members; a member behind the run (a new one) first receives
        the state of one that is not, and returns True (it then takes part whatever
        ``least``). With fewer than ``least`` members (default ``min_members``), wait for more
        up to ``quorum_timeout_s``, then raise DistributedError; a state transfer that failed
        (its sender or this member's connection lost) is tried again at the next agreement.
        Every member must call this at the start of each step, redone ones included."""
        deadline = time.monotonic() + self.quorum_timeout_s
        least = self.min_members if least is None else least
        failing_since: float | None = None
        while True:
            before = self.step
            self._quorum_once()
            failed = self.manager.errored()
            if failed is None and (self.step != before or self.members >= least):
                return self.step != before
            if failed is not None:  # a state transfer (or the group's change) failed: abort
                self.failure = failed.original_exception
                self._verdict()
                self.manager.should_commit()  # torchft's bookkeeping of the abort
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.quorum_timeout_s:
                    raise DistributedError(
                        f"member {self.member_id}: every agreement on the members of step "
                        f"{self.step + 1} failed for {self.quorum_timeout_s:g} s (the last: "
                        f"{_cause(self.failure)}). The run cannot go on step by step: restart "
                        f"it from its latest checkpoint."
                    )
                continue  # agreed again at once, with the members left
            failing_since = None
            self.manager.report_error(DistributedError("too few members"))
            self.manager.should_commit()  # nothing was done: torchft's step is not counted
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"member {self.member_id}: only {self.members} member(s) for step "
                    f"{self.step + 1}, fewer than {least} (min_members={self.min_members}), for "
                    f"{self.quorum_timeout_s:g} s. The run cannot go on step by step: restart "
                    f"it from its latest checkpoint."
                )
            time.sleep(min(0.5, self.quorum_timeout_s / 10))

    def _quorum_once(self) -> None:
        self.failure = None
        try:
            self.manager.start_quorum()
            self._quorum = engine.quorum_id(self.manager)
            self._attempt = self._first_undecided(self._quorum)
        except NNHandlerError:  # ours: a state it cannot take
            raise
        except Exception as error:  # torchft's quorum timed out or its server failed
            first = (str(error).strip().splitlines() or [""])[0]
            raise DistributedError(
                f"member {self.member_id}: no agreement on the members of step {self.step} "
                f"({type(error).__name__}: {first}): the Lighthouse at {self.lighthouse} is "
                f"gone, or fewer than min_members={self.min_members} members are left. The "
                f"run cannot go on step by step: restart it from its latest checkpoint."
            ) from error

    def position_of_run(self, position: str) -> str:
        """The place in the data the members of this attempt train (the first member's to
        say it; this one's is ``position``): every member must be there, or it would sum
        other samples under the same step."""
        key = f"{self.step}/{self._quorum}/{self._attempt}/position"
        try:
            return str(self._verdicts.compare_set(key, "", position).decode())
        except (RuntimeError, OSError) as error:
            raise self._gone(f"the position of step {self.step}", error) from error

    def agree(self, name: str, proposal: str) -> str:
        """The value of ``name`` for the whole run: the first member's to propose one (this
        one's is ``proposal``), kept by the Lighthouse's store while it lives."""
        try:
            return agreed_value(self._verdicts, name, proposal)
        except (RuntimeError, OSError) as error:
            raise self._gone(f"the run's {name}", error) from error

    def lost(self, error: BaseException) -> None:
        """A collective of this step failed: the step will not be committed. The group is
        aborted at once (its connections closed), so that members still waiting in a
        collective on this one fail now instead of at their timeout."""
        self.failure = error
        self.manager.report_error(error)
        self.group.abort()

    def abandoned(self, what: str, error: BaseException) -> str:
        """What a collective's failure says: its cause in one line (gloo's without its source
        location and advice)."""
        return f"{what} of step {self.step + 1} failed: a member was lost ({_cause(error)})"

    def commit(self) -> bool:
        """Whether the step counts: every collective of it completed on every one of its
        members (at least ``min_members``). The same answer on every member; step the
        optimizer only if it is True. Every member must call this once per step."""
        if self.failure is None and self.manager.errored() is not None:
            self.failure = self.manager.errored()  # torchft saw one of ours fail: abort
        step, verdict = self.step, self._verdict()
        if not verdict and self.failure is None:  # another member's failure: not ours
            self.manager.report_error(DistributedError("the step was abandoned by the run"))
        if verdict and not self.manager.should_commit():
            # torchft saw an error after this member voted done (a peer's connection closing
            # once the sums were complete): the run's verdict stands, and torchft's count too.
            counted = {"step": step + 1, "batches_committed": self.manager.batches_committed()}
            self.manager.load_state_dict(counted)
        elif not verdict:
            self.manager.should_commit()  # False: torchft's own bookkeeping of the abort
        return verdict

    def _first_undecided(self, quorum: int) -> int:
        """This step's attempt in ``quorum``: the first without a verdict. Every member of the
        quorum asked for it after the verdicts of the earlier attempts were written (it read
        them, or they were written without its vote), so every member finds the same one."""
        attempt, key = 0, f"{self.step}/{quorum}"
        try:
            while self._verdicts.check([f"{key}/{attempt}/verdict"]):
                attempt += 1
        except (RuntimeError, OSError) as error:  # the store is gone with its Lighthouse
            raise self._gone("the verdicts", error) from error
        return attempt

    def _verdict(self) -> bool:
        """The run's verdict on this attempt of the step: this member's vote (done, or abort
        at once after a failure) then the verdict, written once: commit when every member
        voted done, abort when one failed or a vote is missing after ``timeout_s``."""
        key = f"{self.step}/{self._quorum}/{self._attempt}"
        store, verdict = self._verdicts, f"{key}/verdict"
        try:
            if self.failure is not None:
                store.compare_set(verdict, "", "abort")
            elif store.add(f"{key}/done", 1) >= self.members:
                store.compare_set(verdict, "", "commit")
            deadline, pause = time.monotonic() + self.timeout_s, 0.0005
            while not store.check([verdict]):
                if time.monotonic() > deadline:  # a member gone before its vote
                    store.compare_set(verdict, "", "abort")
                pause = min(pause * 2, 0.05)  # the votes come within a few ms, unless one
                time.sleep(pause)  # never does: then a poll every 50 ms until the deadline
            committed = store.get(verdict) == b"commit"
        except (RuntimeError, OSError) as error:  # the store is gone with its Lighthouse
            raise self._gone(f"the verdict on step {self.step}", error) from error
        if not committed:  # a new group for the next attempt, even with the same members
            engine.forget_quorum(self.manager)
        return committed

    def _gone(self, what: str, error: BaseException) -> DistributedError:
        first = (str(error).strip().splitlines() or [""])[0]  # not torch's C++ frames
        return DistributedError(
            f"member {self.member_id}: {what} cannot be read ({type(error).__name__}: "
            f"{first}): the Lighthouse at {self.lighthouse} is gone. The run cannot go on "
            f"step by step: restart it from its latest checkpoint."
        )

    def close(self) -> None:
        """Leave the run (the others go on without this member)."""
        self.manager.shutdown(wait=False)
        self._verdicts.close()


def _cause(error: BaseException) -> str:
    """An error's first line, without gloo's source location and advice."""
    first = (str(error).strip().splitlines() or [""])[0]
    cause = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return cause or type(error).__name__


__all__ = ["Replica"]
