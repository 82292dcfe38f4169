"""A tiny exact training problem for the fault-tolerance mode's tests (tests/scripts/ft_member.py
runs it as one member; the tests compute the unfailed run with the same functions).

Each step's batch is a pure function of (seed, step); each sample is a micro-batch, owned by the
member whose rank is its index modulo the members; its gradient travels in fixed point (int64),
so the sum, and the weights, are the same bits whoever computed which micro-batch."""

from __future__ import annotations

import hashlib

import torch

SAMPLES, FEATURES, BATCH, STEPS = 48, 4, 6, 24
STEPS_PER_EPOCH = SAMPLES // BATCH
SCALE = 2.0**30
LR = 0.05


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    w = torch.arange(1.0, FEATURES + 1, dtype=torch.float64)
    return x, x @ w + 0.1 * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)


def batch_of(step: int, seed: int = 0) -> list[int]:
    """The sample ids of ``step``: epoch ``step // STEPS_PER_EPOCH``'s permutation, sliced."""
    epoch, index = divmod(step, STEPS_PER_EPOCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [int(i) for i in order[index * BATCH : (index + 1) * BATCH]]


def slots(w: torch.Tensor, ids: list[int], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The int64 row a member sums for the micro-batches ``ids``: the fixed-point gradient,
    then how many samples and the sum of their ids (the ledger's check)."""
    total = torch.zeros(FEATURES + 2, dtype=torch.int64)
    for i in ids:
        grad = 2 * (x[i] @ w - y[i]) * x[i]
        total[:FEATURES] += torch.round(grad * SCALE).to(torch.int64)
        total[FEATURES] += 1
        total[FEATURES + 1] += i
    return total


def apply(w: torch.Tensor, summed: torch.Tensor) -> None:
    w -= LR * (summed[:FEATURES].to(torch.float64) / SCALE) / BATCH


def unfailed(steps: int = STEPS) -> torch.Tensor:
    """The weights after ``steps`` steps in one process."""
    x, y = data()
    w = torch.zeros(FEATURES, dtype=torch.float64)
    for step in range(steps):
        apply(w, slots(w, batch_of(step), x, y))
    return w


def digest(w: torch.Tensor) -> str:
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()


class NoPulse:
    """A Replica's pulse (pulse_watch.PulseWatch) for a test's Replica without a store: no
    member is ever gone."""

    def started(self, attempt: str, members: list[str]) -> None:
        pass

    def ended(self) -> None:
        pass

    def left_in_flight(self) -> None:
        return None

    def close(self) -> None:
        pass


class NoPartition:
    """A Replica's reachability (reachability.Reachability) for a test's Replica without a
    store: nobody is cut off; counts the checks made (one after each failed agreement)."""

    group: tuple[str, list[str]] = ("", [])
    checks = 0

    def leave_if_cut_off(self) -> None:
        self.checks += 1


class NoQuorumClient:
    """A test manager's client (engine.quorum_members reads its last quorum's members)."""

    def __init__(self) -> None:
        self.members: list[str] = []
