"""A fault-tolerant redo adds what a member carries from the abandoned attempt instead of
computing its micro-batches again (reproducible/carried.py, ExactStep.unsent/carried): in one
process, a step's gradients, BatchNorm statistics and loss are the same bits whether its
micro-batches are computed in one attempt or split between a carried sum and a redo, also when
the redo's gradients outgrow the kept scale (it passes over every micro-batch again); and the
redo deals out only the micro-batches no member carries (FaultTolerantSteps._share, with a
test double of the members' sum)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import MicroBatch, StepBatch
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.training.reproducible.exact_step import ExactStep

MICRO, SIZE = 4, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _batch(step: int, target: float = 0.0) -> StepBatch:
    """Micro-batches (inputs, targets); ``target`` for the last two (large: their gradients
    outgrow the scale the first two keep)."""
    x = torch.randn(MICRO * SIZE, 5, generator=torch.Generator().manual_seed(step))
    micro = tuple(
        MicroBatch(
            j, SIZE, (x[j * SIZE : (j + 1) * SIZE], torch.full((SIZE, 1), target * (j >= 2)))
        )
        for j in range(MICRO)
    )
    return StepBatch(step=step, micro=micro, samples=MICRO * SIZE)


def _step(model: nn.Module) -> tuple[ExactStep, Any]:
    config = ReproducibleConfig(global_batch_size=MICRO * SIZE, micro_batch_size=SIZE)
    step = ExactStep(config, model, NullCommunicator(), torch.device("cpu"))
    step.adopt(list(model.parameters()))

    def forward_backward(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        loss = (model(inputs) - targets).pow(2).mean()
        loss.backward()
        return loss.detach()

    return step, forward_backward


def _state(step: ExactStep, loss: torch.Tensor) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in step.module.parameters()]  # type: ignore[union-attr]
    return [*grads, *(b.clone() for b in step.module.buffers()), loss.clone()]


@pytest.mark.parametrize("grow", [1.0, 1e6])
def test_a_redo_that_adds_the_carried_sum_gives_the_bits_of_one_attempt(grow: float) -> None:
    """grow 1e6: the redo's micro-batches' gradients outgrow the scale the first step kept, so
    the step is rescaled: its second pass covers the carried micro-batches too."""
    whole, split = _model(), _model()
    one, fb_one = _step(whole)
    two, fb_two = _step(split)
    two.keeps_unsent = True
    one.run(_batch(0), fb_one, 0)  # the first step sets the scales (nothing is carried)
    two.run(_batch(0), fb_two, 0)
    assert two.unsent is None or two.unsent.global_step == 0
    batch = _batch(1, grow)
    later = batch.micro
    rescaled = one.rescaled_steps
    expected = _state(one, one.run(batch, fb_one, 1))
    assert one.rescaled_steps == rescaled + int(grow > 1)
    before = copy.deepcopy(two.state_dict()), [b.clone() for b in split.buffers()]
    two.run(StepBatch(step=1, micro=later[:2], samples=batch.samples), fb_two, 1)  # "failed"
    carried = two.unsent
    assert carried is not None and carried.indices() == [0, 1]
    two.load_state_dict(before[0])  # what the fault-tolerant steps put back after an abort
    for buffer, value in zip(split.buffers(), before[1], strict=True):
        buffer.copy_(value)
    two.carried = carried
    rescaled = two.rescaled_steps
    found = _state(
        two, two.run(StepBatch(step=1, micro=later[2:], samples=batch.samples), fb_two, 1)
    )
    assert two.carried is None and two.unsent is not None and two.unsent.indices() == [0, 1, 2, 3]
    assert two.rescaled_steps == rescaled + int(grow > 1)  # the redo was rescaled too
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))
    # Without the carried sum the redo's bits differ (the test sees what it checks).
    two.load_state_dict(before[0])
    for buffer, value in zip(split.buffers(), before[1], strict=True):
        buffer.copy_(value)
    alone = _state(
        two, two.run(StepBatch(step=1, micro=later[2:], samples=batch.samples), fb_two, 1)
    )
    assert not torch.equal(alone[0], expected[0])


def test_a_carried_sum_of_another_step_or_scale_is_not_added() -> None:
    model = _model()
    step, forward_backward = _step(model)
    step.keeps_unsent = True
    step.run(_batch(0), forward_backward, 0)
    step.run(_batch(1), forward_backward, 1)
    carried = step.unsent
    assert carried is not None
    assert carried.fits(1, step.scale.exponents) and not carried.fits(2, step.scale.exponents)
    assert not carried.fits(1, None) and not carried.fits(1, step.scale.exponents + 1)
    step.carried = carried  # step 2's run: another step, so nothing is added
    expected_model = _model()
    expected, fb = _step(expected_model)
    expected.load_state_dict(step.state_dict())
    expected_model.load_state_dict(model.state_dict())
    a = _state(step, step.run(_batch(2), forward_backward, 2))
    b = _state(expected, expected.run(_batch(2), fb, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _Member:
    """A Replica in a redo (its members ``agreed``) whose one other member carries
    ``theirs``."""

    agreed = True

    def __init__(self, theirs: list[int], count: int) -> None:
        self.communicator = self
        self.theirs, self.count = theirs, count

    def all_reduce_(self, held: torch.Tensor, op: str) -> torch.Tensor:
        assert op == "sum"
        for index in self.theirs:
            held[index] += 1
        return held


def _redo(mine: list[int], theirs: list[int], rank: int) -> tuple[list[int], Any, Any]:
    """FaultTolerantSteps._share for a member at ``rank`` of 2 carrying ``mine`` of step 1's
    four micro-batches, the other member ``theirs``: the micro-batches it computes, the sum
    it adds, the one it carried."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    model = _model()
    step, forward_backward = _step(model)
    batch = _batch(1)
    step.run(_batch(0), forward_backward, 0)  # scales kept: a carried sum can fit
    steps = FaultTolerantSteps(
        FaultToleranceConfig(lighthouse="http://127.0.0.1:1"), step, step.comm
    )
    assert step.keeps_unsent  # asked for by the fault-tolerant steps
    step.run(
        StepBatch(step=1, micro=tuple(batch.micro[j] for j in mine), samples=16),
        forward_backward,
        1,
    )
    steps._carried = step.unsent
    steps.replica = _Member(theirs, 2)
    dealt = steps._share(batch, rank, 2, 1)
    return [m.index for m in dealt], step.carried, steps._carried


def test_a_redo_deals_out_only_the_micro_batches_no_member_carries() -> None:
    """m0 (rank 0) carried 0 and 2, the other member 1: only 3 is dealt, to rank 0 (the
    first of the redo's two members); rank 1 computes nothing new and adds its own."""
    dealt, added, carried = _redo([0, 2], [1], rank=0)
    assert dealt == [3] and added is carried and added.indices() == [0, 2]
    dealt, added, carried = _redo([1], [0, 2], rank=1)
    assert dealt == [] and added is carried and added.indices() == [1]


def test_a_micro_batch_carried_twice_makes_the_redo_whole() -> None:
    """Two members carrying the same micro-batch (never by construction: a guard): no carried
    sum is added, and the whole step is dealt out again, the same on every member."""
    dealt, added, _ = _redo([0, 2], [2, 3], rank=0)
    assert dealt == [0, 2] and added is None
    dealt, added, _ = _redo([0, 2], [2, 3], rank=1)
    assert dealt == [1, 3] and added is None


class _Recording(_Member):
    """A Replica whose members were agreed, no other member carrying anything; its
    exchanges recorded."""

    def __init__(self) -> None:
        super().__init__([], 2)
        self.exchanges: list[torch.Tensor] = []

    def all_reduce_(self, held: torch.Tensor, op: str) -> torch.Tensor:
        self.exchanges.append(held.clone())
        return super().all_reduce_(held, op)


def test_an_agreed_attempt_with_nothing_carried_exchanges_and_deals_every_micro_batch() -> None:
    """The exchange runs after every agreement (``Replica.agreed``), not only in a redo: two
    members that read the step's past differently (a Lighthouse restarted between their
    reads) still make the same collectives. With nothing carried on any member, every
    micro-batch is dealt as in a first attempt; a step whose members were kept exchanges
    nothing (no collective: the double would count one)."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    model = _model()
    step, forward_backward = _step(model)
    step.run(_batch(0), forward_backward, 0)
    steps = FaultTolerantSteps(
        FaultToleranceConfig(lighthouse="http://127.0.0.1:1"), step, step.comm
    )
    member = _Recording()
    steps.replica = member
    assert [m.index for m in steps._share(_batch(1), 1, 2, 1)] == [1, 3]
    assert len(member.exchanges) == 1 and not member.exchanges[0].any() and step.carried is None
    member.agreed = False
    assert [m.index for m in steps._share(_batch(1), 0, 2, 1)] == [0, 2]
    assert len(member.exchanges) == 1  # none for a step whose members were kept
