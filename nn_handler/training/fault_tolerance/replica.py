"""Replica: one member of a fault-tolerant run (or one rank of it), over torchft's Manager. Each
step:

    replica.next_attempt()    # the step's members: those of the step before, or agreed again
                              # (after an abort, or a join); a member behind first receives
    ... collectives through replica.communicator (ranks: replica.rank of replica.members)
    if replica.commit(place): # every member finished the step: it counts, step it
        optimizer.step()
    else:                     # a member was lost: nothing changed; the same step is redone

The verdict is decided once by the verdicts' store (verdicts.py) from every rank's vote, so
none commits a step another abandons; the members agree on who they are (torchft's quorum)
only when that may have changed (docs/fault-tolerance.md, "What it promises").
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from nn_handler.errors import ConfigError, DistributedError, NNHandlerError, RunFinished
from nn_handler.training.fault_tolerance import engine, quorum
from nn_handler.training.fault_tolerance.communicator import ReplicaCommunicator
from nn_handler.training.fault_tolerance.engine import TCPStore, cause
from nn_handler.training.fault_tolerance.lighthouse import verdicts_of
from nn_handler.training.fault_tolerance.pulse_watch import PulseWatch
from nn_handler.training.fault_tolerance.reachability import Reachability
from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts
from nn_handler.training.fault_tolerance.verdicts import COMMITTED, FINISHED, JOINS, LIFE

Answer = TypeVar("Answer")


class Replica:
    """The member ``member_id`` of the run coordinated by the Lighthouse at ``lighthouse``.

    Args:
        state_dict: the whole state a new member receives (model, optimizer, loop position...).
        load_state_dict: takes that state in a new member.
        min_members: the fewest members a step may commit with.
        host: the address this member listens on and is reached at.
        timeout_s: the longest wait for a collective or a state transfer.
        quorum_timeout_s: the longest wait for a step's members to be agreed, and for a
            Lighthouse that is gone to answer again at its address (restarted).
        init_sync: the first step gives every member the state of one of them.
        group_rank, group_size: this rank in its member, and the member's ranks (each rank
            a Replica; rank i sums and heals with rank i of the others).
        store_port: the member's store's port, where its rank 0 listens (0: a free one).
    """

    #: Whether this attempt's members were agreed (a quorum: the run's first step, after an
    #: abort or a join), not the last step's kept: the same on every member of the attempt
    #: (the verdict says which, a joiner's always is), so that the members may exchange
    #: what they carry from an abandoned attempt of the step (FaultTolerantSteps._share).
    agreed: bool = True
    #: The key of a verdict this member read that a restarted Lighthouse decided otherwise.
    _diverged: str = ""
    #: This process's rank in its member, and the member's ranks.
    group_rank: int = 0
    group_size: int = 1

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
        group_rank: int = 0,
        group_size: int = 1,
        store_port: int = 0,
    ) -> None:
        engine.require_torchft()
        from nn_handler.training.fault_tolerance.transport import VerifiedTransport

        if group_size > 1 and not store_port:
            raise ConfigError(
                f"member {member_id}: a member of {group_size} ranks needs its store's port "
                f"(store_port), the same on each of its ranks: its rank 0 listens there."
            )
        self.member_id = member_id
        self.group_rank, self.group_size = group_rank, group_size
        self.lighthouse = lighthouse
        self.min_members = min_members
        self.timeout_s = timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        timeout = timedelta(seconds=timeout_s)
        # First: an address where no Lighthouse runs is named, with the fix (torchft's own
        # error is a RuntimeError that names neither).
        self._verdicts = ReconnectingVerdicts(
            lighthouse,
            verdicts_of(lighthouse, timeout_s, quorum_timeout_s),
            quorum_timeout_s,
            self._restored,
        )
        # The member's own store, which torchft's Manager needs: its rank 0 listens on it.
        self._store: Any = None
        self._store_port = store_port
        if group_rank == 0:
            self._store = TCPStore(host, store_port, is_master=True, wait_for_workers=False)
            self._store_port = int(self._store.port)
        self.group: Any = engine.member_group(timeout, self._group_label)
        try:
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
                rank=group_rank,
                world_size=group_size,
                store_port=self._store_port,
                lighthouse_addr=lighthouse,
                replica_id=member_id,
                checkpoint_transport=VerifiedTransport(self.group, timeout),
                init_sync=init_sync,
            )
        except RuntimeError as error:  # the Lighthouse's quorum port did not answer
            self._verdicts.close()
            raise DistributedError(
                f"member {member_id}: cannot reach the Lighthouse at {lighthouse} within "
                f"{timeout_s:g} s ({cause(error)}): is it running there?"
            ) from None
        self.communicator = ReplicaCommunicator(self)
        #: The collective failure of the step in flight (None: none).
        self.failure: BaseException | None = None
        # A member of the attempt gone (its process ended, or silent) ends it now (pulses.py).
        self._pulse = PulseWatch(
            self._verdicts.address, engine.replica_id(self.manager), timeout_s + 5, group_size
        )
        self._reach = Reachability(  # a member cut off from the others leaves (reachability.py)
            self._verdicts, lighthouse, self._pulse.member, f"{host}:{self.store_port}", timeout_s
        )
        self._ask("the run's members", self._reach.register)
        # The step's attempt within its quorum (the members the Lighthouse agreed on): the
        # first whose verdict is not written yet (see _quorum_once).
        self._quorum = -1
        self._attempt = 0
        #: How the next attempt starts, as the last verdict says: "same" members (a commit,
        #: no join asked), "agree" on them again (a commit after a join was asked), or "ask"
        #: to be a member and agree (an abort: one of them may be left out of the quorum).
        self._next = "ask"
        #: The place in the data of the run's last attempt (the first member's to vote).
        self.run_position = ""

    @property
    def store_port(self) -> int:
        """The port of this member's store (torch's TCPStore, which its rank 0 listens on, on
        every interface as torchrun's does)."""
        return self._store_port

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

    @property
    def voter(self) -> str:
        """This rank's name as a voter (a member of one rank: the member's)."""
        return self.member_id if self.group_size == 1 else f"{self.member_id}/{self.group_rank}"

    @property
    def voters(self) -> int:
        """How many votes commit the current step: one per rank of each member."""
        return self.members * self.group_size

    def next_attempt(self) -> None:
        """Start the next attempt of a step: with the last attempt's members when the verdict
        says so, else agreed again (``begin_step``). Every member must call this at the start
        of each step after its first, redone ones included."""
        if self._next == "same":
            self._attempt = 0  # a new step: its first attempt, with the same members
            self.agreed = False
            self._started()
        else:
            self.begin_step(ask=self._next == "ask")

    def begin_step(self, least: int | None = None, ask: bool = True) -> bool:
        """Agree on this step's members; a member behind the run first receives the state of
        one that is not, and returns True. With fewer than ``least`` (default
        ``min_members``), wait up to ``quorum_timeout_s``, then raise DistributedError; a
        failed state transfer is tried again at the next agreement. Called before the first
        step and whenever ``next_attempt`` says to. With ``ask`` it first asks to be a member
        (``JOINS``, again every second while it waits), so that the others agree again at
        their next step but one."""
        if not ask:
            return self._agree(least, ask)
        self._ask("the run's members", self._raise_if_finished)
        self._ask("the run's members", lambda: self._verdicts.add(JOINS, 1))
        asked = threading.Event()
        threading.Thread(target=self._ask_again, args=(asked,), daemon=True).start()
        try:
            return self._agree(least, ask)
        finally:
            asked.set()

    def finish(self) -> None:
        """The run's last step is committed: a member that starts later leaves at once
        (RunFinished). Any member may call this at its run's end; the first one's is kept."""
        self._ask("the run's end", lambda: self._verdicts.compare_set(FINISHED, "", str(self.step)))

    def _raise_if_finished(self) -> None:
        """RunFinished if a member said the run's last step is committed (``finish``)."""
        if self._verdicts.check([FINISHED]):
            step = int(self._verdicts.get(FINISHED).decode())
            raise RunFinished(self.member_id, step, self.lighthouse)

    def _ask_again(self, asked: threading.Event) -> None:
        """Ask to join again every second (a tenth of ``quorum_timeout_s`` if less) until
        ``asked``: the first ask may reach the others before this member's quorum request
        reaches the Lighthouse (a loaded machine). Each costs them one agreement at most."""
        while not asked.wait(min(1.0, self.quorum_timeout_s / 10)):
            with contextlib.suppress(RuntimeError, OSError):  # the quorum's own error says it
                self._verdicts.add(JOINS, 1)

    def _agree(self, least: int | None, asked: bool) -> bool:
        """``begin_step`` once ``asked`` (or not): a member that asked learns after each
        quorum whether the run finished while it waited (the others gone, it may be alone)."""
        deadline = time.monotonic() + self.quorum_timeout_s
        least = self.min_members if least is None else least
        failing_since: float | None = None
        while True:
            before = self.step
            self._quorum_once()
            if asked:
                self._ask("the run's end", self._raise_if_finished)
            failed = self.manager.errored()
            behind = failed is None and self._behind()
            if failed is None and not behind and (self.step != before or self.members >= least):
                self._started()
                return self.step != before
            if failed is not None:  # a state transfer (or the group's change) failed: abort
                self.failure = failed.original_exception
                self._vote("")
                self.manager.should_commit()  # torchft's bookkeeping of the abort
                self._ask("who reaches whom", self._reach.leave_if_cut_off)  # a partition?
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.quorum_timeout_s:
                    raise DistributedError(
                        f"member {self.member_id}: every agreement on the members of step "
                        f"{self.step + 1} failed for {self.quorum_timeout_s:g} s (the last: "
                        f"{cause(self.failure)}). The run cannot go on step by step: restart "
                        f"it from its latest checkpoint."
                    )
                continue  # agreed again at once, with the members left
            failing_since = None
            self.manager.report_error(DistributedError("too few members"))
            self.manager.should_commit()  # nothing was done: torchft's step is not counted
            if time.monotonic() > deadline:
                stuck = (
                    f"members that hold {self.step} of the run's {behind} committed steps "
                    f"(every member with the run's state is gone or left out)"
                    if behind
                    else f"only {self.members} member(s) for step {self.step + 1}, fewer than "
                    f"{least} (min_members={self.min_members})"
                )
                raise DistributedError(
                    f"member {self.member_id}: {stuck}, for {self.quorum_timeout_s:g} s. The "
                    f"run cannot go on step by step: restart it from its latest checkpoint."
                )
            time.sleep(min(0.5, self.quorum_timeout_s / 10))

    def _behind(self) -> int:
        """The run's committed steps when this quorum's members hold fewer (none of them has
        the run's state: new members alone, say; they must not start it again), else 0."""
        done = int(self._ask("the run's steps", lambda: self._verdicts.value(COMMITTED, "-1")))
        return done + 1 if self.step <= done else 0

    def _quorum_once(self) -> None:
        """One quorum (torchft's), asked again once of a Lighthouse restarted while it waited
        (quorum.py); this attempt's place in it."""
        self.failure = None
        try:
            quorum.start_quorum(
                self.manager,
                self._verdicts,
                functools.partial(self._ask, "the run's members"),
                self.quorum_timeout_s,
            )
        except NNHandlerError:  # ours: a state it cannot take
            raise
        except Exception as failure:
            raise DistributedError(
                f"member {self.member_id}: no agreement on the members of step {self.step} "
                f"({type(failure).__name__}: {cause(failure)}): the Lighthouse at "
                f"{self.lighthouse} is gone, or fewer than min_members={self.min_members} are "
                f"left. The run cannot go on step by step: restart it from its latest checkpoint."
            ) from failure
        self._quorum = engine.quorum_id(self.manager)
        self._attempt = self._first_undecided(self._quorum)
        self._next, self.agreed = "same", True

    def agree(self, name: str, proposal: str) -> str:
        """The value of ``name`` for the whole run: the first member's to propose one (this
        one's is ``proposal``), kept by the Lighthouse's store while it lives."""
        key = f"agreed/{name}"
        return self._ask(
            f"the run's {name}", lambda: self._verdicts.compare_set(key, "", proposal).decode()
        )

    def _started(self) -> None:
        """This attempt's members agreed: a member of it gone from now on ends it."""
        self._pulse.started(self._key, engine.quorum_members(self.manager))

    def wait(self, work: Any) -> None:
        """The end of the collective ``work``: its error, or at once a member of the attempt
        gone (PulseWatch.wait)."""
        self._pulse.wait(work, self.timeout_s)

    def lost(self, error: BaseException) -> None:
        """A collective of this step failed: it will not be committed. The group is aborted
        at once, so that the others' collectives waiting on this one fail now."""
        self.failure = error
        self.manager.report_error(error)
        in_flight = self._pulse.left_in_flight()
        if in_flight is None:
            self.group.abort()
        else:  # ``wait`` ended for a member gone: torchft's abort would wait for it
            engine.abort_later(self.group, in_flight, timedelta(seconds=self.timeout_s))

    def abandoned(self, what: str, error: BaseException) -> str:
        """What a collective's failure says: its cause in one line (gloo's without its source
        location and advice)."""
        return f"{what} of step {self.step + 1} failed: a member was lost ({cause(error)})"

    def commit(self, position: str = "", leaving: bool = False) -> bool:
        """Whether the step counts: its collectives completed on every rank of its members,
        all at ``position`` in the data; the same answer everywhere (step the optimizer only
        then). ``leaving``: this member leaves after this step (preempted). Every rank of every
        member must call this once per attempt."""
        if self.failure is None and self.manager.errored() is not None:
            self.failure = self.manager.errored()  # torchft saw one of ours fail: abort
        step, members = self.step, self.members
        if self._vote(position, leaving):  # torchft's count of it (its own vote is not needed)
            committed = self.manager.batches_committed() + members
            self.manager.load_state_dict({"step": step + 1, "batches_committed": committed})
            return True
        if self.failure is None:  # another member's failure, or a place that differs
            self.manager.report_error(DistributedError("the step was abandoned by the run"))
        self.manager.should_commit()  # False: torchft's own bookkeeping of the abort
        return False

    def _first_undecided(self, quorum: int) -> int:
        """This step's attempt in ``quorum``: the first without a verdict (every member asks
        after the earlier attempts' verdicts were written: all find the same one)."""
        key = f"{self.step}/{quorum}"

        def decided(attempt: int) -> bool:
            return self._verdicts.check([f"{key}/{attempt}/verdict"])

        attempt = 0
        while self._ask("the verdicts", functools.partial(decided, attempt)):
            attempt += 1
        return attempt

    def _group_label(self, quorum: int) -> str:
        """The store prefix of this step's attempt's group in ``quorum`` of this Lighthouse's
        life (members that read it differently never form a group: agreed again)."""
        attempt = self._first_undecided(quorum)
        label = f"{self._ask('the run', lambda: self._verdicts.value(LIFE, ''))}.{attempt}"
        self._reach.group = f"{quorum}/{label}", engine.quorum_members(self.manager)
        return label

    def _vote(self, position: str, leaving: bool = False) -> bool:
        """This rank's vote (done, or abort after a failure) and the run's verdict, in one
        request: commit when every rank of every member voted done at the same place in the
        data, abort at a failure or a vote missing after ``timeout_s``."""
        key, done = self._key, self.failure is None
        try:
            committed, self.run_position, again = self._ask(
                f"the verdict on step {self.step}",
                lambda: self._verdicts.vote(
                    key, self.voters, done, position, self.timeout_s, leaving, self.voter
                ),
            )
        finally:
            self._pulse.ended()
        self._next = "same" if committed and not again else "agree" if committed else "ask"
        if not committed:  # a new group for the next attempt, even with the same members
            engine.forget_quorum(self.manager)
        return committed

    @property
    def _key(self) -> str:
        """This attempt's name in the verdicts' store: ``step/quorum/attempt``."""
        return f"{self.step}/{self._quorum}/{self._attempt}"

    def _ask(self, what: str, request: Callable[[], Answer]) -> Answer:
        """``request``'s answer from the verdicts' store (``what``: what it reads, for its
        error): a DistributedError once no Lighthouse answered for ``quorum_timeout_s``, or
        once a restarted one decided otherwise a verdict this member read (``_restored``)."""
        try:
            answer = request()
        except NNHandlerError:
            raise
        except (RuntimeError, OSError) as error:  # its first line: not torch's C++ frames
            raise DistributedError(
                f"member {self.member_id}: {what} cannot be read ({type(error).__name__}: "
                f"{cause(error)}): the Lighthouse at {self.lighthouse} is gone (no "
                f"answer there for {self.quorum_timeout_s:g} s). The run cannot go on step by "
                f"step: restart it from its latest checkpoint."
            ) from error
        if self._diverged:
            raise DistributedError(
                f"member {self.member_id}: the Lighthouse at {self.lighthouse} was restarted "
                f"and the run decided {self._diverged} otherwise than this member read it "
                f"(every other member that read it was lost): this member left the run's "
                f"bits, and leaves. Restart it: it joins the run with a live member's state."
            )
        return answer

    def _restored(self, differing: list[str]) -> None:
        """A restarted Lighthouse answered: the next quorum builds a new group whatever its id;
        a verdict it holds that differs from this member's is kept to be said (``_ask``)."""
        engine.forget_quorum(self.manager)
        self._diverged = next((key for key in differing if key.endswith("/verdict")), "")

    def close(self) -> None:
        """Leave the run (the others go on without this member)."""
        self._pulse.close()
        self.manager.shutdown(wait=False)
        self._verdicts.close()


__all__ = ["Replica"]
