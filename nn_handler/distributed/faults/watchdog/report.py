"""The one message a stall or a mismatch produces, built from every rank's published state
(pure functions: the watchdog thread gathers the states, these only read them)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from nn_handler.distributed.faults.watchdog.records import RankState, Record, describe, ranks_text

HOW_TO_READ = (
    "Every rank must issue the same collectives in the same order. A rank that has not arrived "
    "is either still running (its stack shows where: a slow or stuck hook, data loading, a "
    "deadlock) or took another code path (a collective skipped or added under an `if rank`). "
    "See docs/troubleshooting.md."
)


def stalled_ranks(states: Mapping[int, RankState]) -> tuple[int, list[int]]:
    """The newest collective number any waiting rank is in, and the ranks not inside it."""
    waiting = [s.seq for s in states.values() if s.inside]
    newest = max(waiting) if waiting else max((s.seq for s in states.values()), default=0)
    behind = [r for r, s in states.items() if not (s.inside and s.seq == newest)]
    return newest, sorted(behind)


def _rank_line(state: RankState, newest: int) -> str:
    latest = describe(state.latest)
    if state.inside and state.seq == newest:
        return f"rank {state.rank}: waiting {state.seconds:.1f} s in {latest}"
    if state.inside:
        return (
            f"rank {state.rank}: waiting {state.seconds:.1f} s in {latest}, an earlier "
            f"collective than the others"
        )
    now = f"; now at {state.where_now}" if state.where_now else ""
    return f"rank {state.rank}: not in a collective for {state.seconds:.1f} s (last: {latest}){now}"


def diverging_lines(states: Mapping[int, RankState]) -> tuple[int, Record, Record] | None:
    """The newest collective number at which two ranks issued the same operation from
    different lines of code (legitimate in ``if rank == 0: ... else: ...`` code, and the trace
    of a skipped collective when the stall follows)."""
    ranks = sorted(states)
    for first, second in itertools.pairwise(ranks):
        mine = {r.seq: r for r in states[first].records}
        for record in reversed(states[second].records):
            other = mine.get(record.seq)
            if other is not None and other.where != record.where:
                return record.seq, other, record
    return None


def stall_report(
    states: Mapping[int, RankState],
    reporter: int,
    stall_timeout: float,
    silent: Mapping[int, str],
) -> tuple[str, list[int]]:
    """The stall's report and the ranks it blames (not arrived, or silent)."""
    newest, behind = stalled_ranks(states)
    waited = states[reporter].seconds
    blamed = sorted(set(behind) | set(silent))
    where = describe(states[reporter].latest)
    if blamed:
        verb = "has" if len(blamed) == 1 else "have"
        arrival = f"{ranks_text(blamed)} {verb} not arrived."
    else:
        arrival = "every rank is in it."
    lines = [
        f"Collective stall: rank {reporter} waited {waited:.1f} s (stall_timeout "
        f"{stall_timeout:g} s) in {where}; {arrival}",
    ]
    lines += [f"  {_rank_line(states[r], newest)}" for r in sorted(states)]
    lines += [f"  rank {r}: did not answer: {why}" for r, why in sorted(silent.items())]
    diverged = diverging_lines(states)
    if diverged is not None:
        seq, first, second = diverged
        lines.append(
            f"At collective #{seq} the ranks were on different lines: {first.where} and "
            f"{second.where} (legitimate in rank-dependent code; otherwise a rank skipped or "
            f"added a collective before it)."
        )
    for rank in blamed:
        state = states.get(rank)
        if state is not None and state.stack:
            lines.append(f"Stack of rank {rank} (its training thread, innermost last):")
            lines += [f"    {line}" for line in state.stack.rstrip().splitlines()]
    lines.append(HOW_TO_READ)
    return "\n".join(lines), blamed


def no_stall(states: Mapping[int, RankState], seq: int, world_size: int) -> str | None:
    """Why waiting past the stall timeout in collective ``seq`` is no stall, or None when it
    is one: every rank is in that collective (a slow step: nobody is missing), or the ranks
    not in it are working on purpose (inside ``Communicator.patient()``). Needs every rank's
    state; with one missing it is a stall."""
    if len(states) < world_size:
        return None
    missing = sorted(r for r, s in states.items() if not (s.inside and s.seq == seq))
    if not missing:
        return "every rank is in it: a slow step, not a stall"
    if all(states[r].busy for r in missing):
        verb = "is" if len(missing) == 1 else "are"
        return f"{ranks_text(missing)} {verb} working inside Communicator.patient()"
    return None


def mismatch_signatures(states: Mapping[int, RankState], seq: int, world_size: int) -> list[str]:
    """What each rank issued as collective ``seq``, by rank, for CollectiveMismatchError."""
    texts = []
    for rank in range(world_size):
        state = states.get(rank)
        record = state.at(seq) if state is not None else None
        if state is None:
            texts.append("(did not answer)")
        elif record is None:
            texts.append(f"(no record of #{seq}; latest: {describe(state.latest)})")
        else:
            texts.append(f"{record.what} at {record.where}")
    return texts


__all__ = [
    "HOW_TO_READ",
    "diverging_lines",
    "mismatch_signatures",
    "no_stall",
    "stall_report",
    "stalled_ranks",
]
