"""The names the CheckpointManager gives checkpoints (periodic, best, top-k), their order, and
how many times a launcher restarted the job."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

BEST = "best.pt"
BEST_SHARDED = "best"
PERIODIC = re.compile(r"^ckpt-e(\d+)-s(\d+)(?:-r[0-9a-f]+)?(\.pt)?$")
_COUNT = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() accepts '¹', int() does not
#: The variable ``nn-handler supervise`` gives a restarted member (1 at its first restart), as
#: torchrun gives its restarted workers TORCHELASTIC_RESTART_COUNT: a member's own, which a
#: torchrun inside the member passes on to its ranks unchanged.
SUPERVISE_RESTART_COUNT = "NN_HANDLER_RESTART_COUNT"


def periodic_name(epoch: int, step: int, sharded: bool = False) -> str:
    """The name of the periodic checkpoint after ``epoch`` epochs and ``step`` steps (a
    folder's, without ``.pt``, when ``sharded``)."""
    return f"ckpt-e{epoch:04d}-s{step:08d}{'' if sharded else '.pt'}"


def restart_count(env: Mapping[str, str]) -> int:
    """How many times torchrun (TORCHELASTIC_RESTART_COUNT), SLURM (SLURM_RESTART_COUNT) or
    ``nn-handler supervise`` (NN_HANDLER_RESTART_COUNT, a fault-tolerant member's) has
    restarted this job; 0 for a first start. Unparseable values count as 0."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", SUPERVISE_RESTART_COUNT):
        value = env.get(name, "").strip()
        if _COUNT.fullmatch(value) and int(value) > 0:
            return int(value)
    return 0


def is_checkpoint_name(name: str) -> bool:
    """A name the manager gives checkpoints (periodic, best, top-k)."""
    return bool(PERIODIC.match(name)) or name in (BEST, BEST_SHARDED) or name.startswith("top-")


def order(path: Path) -> tuple[int, int]:
    match = PERIODIC.match(path.name)
    return (int(match.group(2)), int(match.group(1))) if match else (-1, -1)


__all__ = [
    "PERIODIC",
    "BEST",
    "BEST_SHARDED",
    "SUPERVISE_RESTART_COUNT",
    "is_checkpoint_name",
    "order",
    "periodic_name",
    "restart_count",
]
