"""What a member must share with the run to be one of its members: a fingerprint of what makes
the bits (the run's own fingerprint: the optimizer and its hyperparameters, precision, the
mode's seed and batch sizes...; the model's parameters and buffers, by name, shape and dtype;
the threads per process, whose count changes a CPU kernel's float sums; torch's version). The
members agree on one through the Lighthouse, the first member's (``Replica.agree``), before
their first step and at every join: a member that differs is refused by name, with each field
it differs on, before it takes part in any step, and the others go on. Two runs pointed at one
Lighthouse are two fingerprints: the second is refused, never merged into the first."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.checkpoint.run_identity import field_differences
from nn_handler.errors import ConfigError, DistributedError


def member_fingerprint(run: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """This member's fingerprint: the run's (``run``, checkpoint/run_identity.py) and the
    model's, threads' and torch's."""
    state = module.state_dict()
    layout = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in state.items())
    return {
        **dict(run),
        "model.values": sum(t.numel() for t in state.values()),
        "model.layout": hashlib.sha256(layout.encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def fingerprint_text(mine: Mapping[str, Any]) -> str:
    """``mine`` as the run's members compare it."""
    return json.dumps(dict(mine), sort_keys=True, default=str)


def join_the_run(
    member: str, mine: Mapping[str, Any], lighthouse: str, timeout_s: float, wait_s: float = 0.0
) -> None:
    """Agree on the run's fingerprint with the Lighthouse at ``lighthouse`` (the first
    member's to propose one; reached within ``wait_s``: one being restarted), before this
    member has a replica there (so no quorum ever waits for a member that is refused); a
    ConfigError naming every field on which ``mine`` differs from it. Every member calls this
    before its first step (and ``check_fingerprint`` after it: a Lighthouse restarted in
    between learns the run's from its members)."""
    from nn_handler.training.fault_tolerance.lighthouse import agreed_value, verdicts_of

    proposal = fingerprint_text(mine)
    store = verdicts_of(lighthouse, timeout_s, wait_s)
    try:
        agreed = agreed_value(store, "fingerprint", proposal)
    except (RuntimeError, OSError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise DistributedError(
            f"member {member}: the run's settings cannot be read ({type(error).__name__}: "
            f"{first}): is the Lighthouse at {lighthouse} running?"
        ) from error
    finally:
        store.close()
    check_fingerprint(member, mine, agreed, lighthouse)


def check_fingerprint(member: str, mine: Mapping[str, Any], agreed: str, lighthouse: str) -> None:
    """A ConfigError naming every field on which ``mine`` differs from the run's
    fingerprint ``agreed`` (none: nothing)."""
    if agreed == fingerprint_text(mine):
        return
    try:
        run = json.loads(agreed)
    except ValueError:
        run = {}
    fields = field_differences(mine, run, ("here", "in the run"))
    raise ConfigError(
        f"member {member} is refused by the run of the Lighthouse at {lighthouse}: its "
        f"settings differ from the run's (those of its first member) in "
        f"{'; '.join(fields) or 'their encoding'}. Its steps would leave the run's bits (or "
        f"break its sums), so it takes no part; the others go on. Start it with the run's "
        f"settings, or give a run of other settings a Lighthouse of its own."
    )


__all__ = ["check_fingerprint", "fingerprint_text", "join_the_run", "member_fingerprint"]
