"""Where a step's time goes: the parts, their shares, and a verdict when one dominates.

Pure arithmetic on seconds (the ThroughputMonitor measures them): ``data`` waiting for the
next batch, ``compute`` (forward, backward, optimizer), ``comm`` the gradient reduction left
after backward ended (exposed), ``checkpoint`` step checkpoints and preemption checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

#: A part dominates at this share of the step time or more.
DOMINANT = 0.5

PARTS = ("data", "compute", "comm", "checkpoint")

#: What each part means and what to do, in the order the verdict considers them: waiting
#: for data or checkpoints is a cause; a rank's exposed communication may be it waiting for
#: a slower rank, so it is named only when no rank waits on data or checkpoints.
ADVICE = {
    "data": (
        "waiting for batches",
        "raise num_workers{pin_memory}, or use rank-cached loading (loader mode rank_cached)",
    ),
    "checkpoint": (
        "writing checkpoints",
        "save less often (every_n_steps){background}",
    ),
    "comm": (
        "in gradient reduction not overlapped with backward",
        "larger batches per rank, gradient accumulation, or a faster interconnect",
    ),
}


@dataclass
class StepTimes:
    """Seconds summed over an epoch's steps on one rank; ``wall`` is the whole loop's."""

    steps: float = 0.0
    wall: float = 0.0
    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    checkpoint: float = 0.0

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> StepTimes:
        return cls(*(float(v) for v in values))

    def shares(self) -> dict[str, float]:
        """Each part's share of the wall time (0 to 1; they need not sum to 1: the rest is
        the loop's own bookkeeping and hooks)."""
        if self.wall <= 0:
            return dict.fromkeys(PARTS, 0.0)
        return {part: min(max(getattr(self, part) / self.wall, 0.0), 1.0) for part in PARTS}


def advice(part: str, cuda: bool, background_saves: bool = False) -> str:
    """What to do about ``part``; pinned memory is advised only where it helps (CUDA), and
    background saves only to a run that does not make them already."""
    faster = ", or a faster disk (or store) for checkpoint.dir"
    background = faster if background_saves else " or use sharded checkpoints with async_save"
    return ADVICE[part][1].format(pin_memory=", pin_memory" if cuda else "", background=background)


def verdict(
    shares_by_rank: Sequence[Mapping[str, float]],
    cuda: bool = False,
    background_saves: bool = False,
) -> str | None:
    """One line when a part other than compute takes at least ``DOMINANT`` of the step on
    some rank: the first such part in ``ADVICE``'s order, on the rank where its share is
    largest (named when there are several ranks); None when compute dominates or nothing
    does. ``cuda``: the run trains on CUDA devices; ``background_saves``: it saves sharded
    checkpoints in the background already."""
    for part, (what, _fix) in ADVICE.items():
        share, rank = max(
            ((shares.get(part, 0.0), -rank) for rank, shares in enumerate(shares_by_rank)),
            default=(0.0, 0),
        )
        if share >= DOMINANT:
            where = f" on rank {-rank}" if len(shares_by_rank) > 1 else ""
            bound = "communication" if part == "comm" else part
            fix = advice(part, cuda, background_saves)
            return f"{bound}-bound: {share:.0%} of the step {what}{where}; {fix}"
    return None


__all__ = ["ADVICE", "DOMINANT", "PARTS", "StepTimes", "advice", "verdict"]
