"""The kill campaign's oracles (tests/scripts/ft_campaign.py), on made-up ledgers: what its
report says about a run must be able to fail. A step only a member killed later committed is
checked like any other; the recovery time is counted to the first step the victim cannot
have been part of, not to a commit of the step it may have voted on."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.ft_helpers import BATCH, batch_of

SCRIPT = Path(__file__).parents[1] / "scripts" / "ft_campaign.py"


@pytest.fixture(scope="module")
def campaign() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ft_campaign", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ft_campaign", module)
    spec.loader.exec_module(module)
    return module


def _entry(step: int, when: float, whole: bool = True) -> tuple[int, float, int, int]:
    ids = batch_of(step)
    return (step, when, BATCH, sum(ids)) if whole else (step, when, BATCH - 1, sum(ids[1:]))


def _report(steps: range) -> dict[str, Any]:
    return {"ledger": [[s, BATCH, sum(batch_of(s)), 2, 0.0] for s in steps]}


def test_a_step_only_a_killed_member_committed_is_checked_for_its_samples(
    campaign: ModuleType,
) -> None:
    finished = {"m0": _report(range(0, 3)), "m1": _report(range(4, 6))}
    # m2 committed step 3 alone (the others caught up past it) and was killed later.
    whole = {"m2": [_entry(2, 1.0), _entry(3, 2.0)]}
    assert campaign.ledger_problems(finished, whole, 6) == []
    partial = {"m2": [_entry(2, 1.0), _entry(3, 2.0, whole=False)]}
    assert campaign.ledger_problems(finished, partial, 6) == [
        "steps without all their samples: [3]"
    ]


def test_missing_steps_and_a_step_committed_twice_are_named(campaign: ModuleType) -> None:
    finished = {"m0": _report(range(0, 3))}
    twice = {"m2": [_entry(1, 1.0), _entry(1, 2.0)]}
    assert campaign.ledger_problems(finished, twice, 4) == [
        "m2: a step committed twice or out of order",
        "steps never committed: [3]",
    ]


def test_a_run_started_again_by_new_members_is_named(campaign: ModuleType) -> None:
    """New members alone that trained the run again from step 0 (its members all gone) reach
    the same bits from the same start: only the second commit of its steps, seconds after
    the first, tells it (one verdict is read by a step's members within a second)."""
    finished = {"j8": _report(range(0, 3))}
    first = {"m0": [_entry(0, 1.0), _entry(1, 1.1), _entry(2, 1.2)]}
    again = {**first, "j8": [_entry(0, 9.0), _entry(1, 9.1), _entry(2, 9.2)]}
    assert campaign.ledger_problems(finished, again, 3) == [
        "steps committed again, by a run started again: [0, 1, 2]"
    ]
    together = {**first, "j8": [_entry(0, 1.3), _entry(1, 1.1), _entry(2, 1.2)]}
    assert campaign.ledger_problems(finished, together, 3) == []


def test_the_recovery_is_timed_to_a_step_the_victim_cannot_have_been_in(
    campaign: ModuleType,
) -> None:
    kill = {"member": "m1", "kind": "death", "time": 10.0}
    # The victim was at step 7 when it was killed: the others' commit of step 7 at 10.2 may
    # hold its vote; step 8 at 11.5 cannot.
    commits = {"m0": [_entry(6, 9.5), _entry(7, 10.2), _entry(8, 11.5)], "m1": [_entry(6, 9.5)]}
    assert campaign.recovery_s(kill, 7, commits) == pytest.approx(1.5)
    # A victim that had not begun a step: the next commit counts; none after: None.
    assert campaign.recovery_s(kill, -1, commits) == pytest.approx(0.2)
    assert campaign.recovery_s(kill, 8, commits) is None
