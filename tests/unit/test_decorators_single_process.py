"""on_rank and main_process_first in one process: call or skip, exceptions unchanged."""

from __future__ import annotations

import pytest

from nn_handler.errors import ConfigError
from nn_handler.utils.ddp_decorators import main_process_first, on_rank


def test_on_rank_calls_rank_zero_and_skips_others() -> None:
    calls: list[str] = []

    @on_rank(0)
    def save(path: str) -> str:
        calls.append(path)
        return f"saved {path}"

    @on_rank([1, 2])
    def elsewhere() -> str:
        calls.append("elsewhere")
        return "never"

    assert save("model.pth") == "saved model.pth"
    assert elsewhere() is None
    assert calls == ["model.pth"]
    assert save.__name__ == "save", "functools.wraps keeps the name"


def test_on_rank_reraises_the_original_exception_unchanged() -> None:
    error = OSError("disk full")

    @on_rank(0, barrier=True)
    def save() -> None:
        raise error

    with pytest.raises(OSError) as info:
        save()
    assert info.value is error


@pytest.mark.parametrize("bad", [-1, [], [0, "1"], True, 1.5])
def test_on_rank_rejects_bad_ranks(bad: object) -> None:
    with pytest.raises(ConfigError, match="on_rank takes a rank"):
        on_rank(bad)  # type: ignore[arg-type]


def test_broadcast_needs_exactly_one_rank() -> None:
    with pytest.raises(ConfigError, match=r"exactly one rank, got \[0, 1\]"):
        on_rank([0, 1], broadcast=True)


def test_main_process_first_just_runs_the_body_in_one_process() -> None:
    ran = []
    with main_process_first():
        ran.append(1)
    with pytest.raises(KeyError), main_process_first(local=True):
        raise KeyError("unchanged")
    assert ran == [1]
