"""The error family and rank-aware logging."""

from __future__ import annotations

import pickle
import sys
import textwrap
import traceback

import pytest
from loguru import logger

from nn_handler import disable_logging, enable_logging
from nn_handler.errors import (
    CheckpointError,
    CollectiveMismatchError,
    CollectiveStallError,
    ConfigError,
    DistributedError,
    NNHandlerError,
    RankFailedError,
    summarize_traceback,
)
from tests.harness import run_command


def test_errors_are_also_the_builtins_callers_catch() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, NNHandlerError)
    for error in (DistributedError, RankFailedError, CollectiveMismatchError, CheckpointError):
        assert issubclass(error, RuntimeError) and issubclass(error, NNHandlerError)


def test_rank_failed_error_names_ranks_and_survives_pickling() -> None:
    error = RankFailedError("step", {3: "ValueError: x", 1: "KeyError: y"})
    assert error.failed_ranks == [1, 3]
    assert "step failed on rank(s) [1, 3]" in str(error) and "--- rank 3 ---" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert copy.failed_ranks == [1, 3] and str(copy) == str(error)


def _raise_in_getitem() -> None:
    samples: dict[int, int] = {}
    samples[46]  # the innermost line


def _formatted(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except BaseException as error:
        return "".join(traceback.format_exception(error))
    raise AssertionError("no error")


def test_a_brief_rank_failed_error_names_each_error_and_line_in_one_line() -> None:
    text = _formatted(_raise_in_getitem)
    line = _raise_in_getitem.__code__.co_firstlineno + 2
    error = RankFailedError("training", {1: text}, note="rank 0 stopped because of it.", brief=True)
    assert str(error).splitlines() == [
        "training failed on rank(s) [1]:",
        f"--- rank 1 --- KeyError: 46 at {__file__}:{line} in _raise_in_getitem "
        "(the traceback: rank 1's output, or .rank_messages)",
        "rank 0 stopped because of it.",
    ]
    assert error.rank_messages == {1: text}  # the whole traceback stays on the error
    copy = pickle.loads(pickle.dumps(error))
    assert copy.brief and str(copy) == str(error)
    full = RankFailedError("training", {1: text})
    assert "Traceback (most recent call last)" in str(full) and not full.brief


def test_summarize_traceback_keeps_how_a_rank_left_and_chained_errors_last() -> None:
    def chained() -> None:
        try:
            _raise_in_getitem()
        except KeyError as error:
            raise ValueError("bad sample\nsecond line") from error

    summary = summarize_traceback(_formatted(chained))
    assert summary.startswith("ValueError: bad sample second line at ")
    assert summary.endswith(" in chained"), summary
    exited = "SystemExit (exit status 3)\n" + _formatted(lambda: sys.exit(3))
    assert summarize_traceback(exited).startswith("SystemExit (exit status 3): SystemExit: 3 at ")
    assert summarize_traceback("killed by SIGKILL\n(gone without a word)") == (
        "killed by SIGKILL (gone without a word)"
    )


def test_a_stall_error_printed_elsewhere_says_its_first_line_and_who_printed_it() -> None:
    report = "Collective stall: rank 0 waited 2 s\n  rank 0: waiting\nStack of rank 1"
    whole = CollectiveStallError(report, [1])
    assert str(whole) == report and whole.printed_by is None
    brief = CollectiveStallError(report, [1], printed_by=0)
    assert str(brief).splitlines() == [
        "Collective stall: rank 0 waited 2 s",
        "(the whole report, with each rank's state and stack, was printed by rank 0 when it "
        "found the stall; it is also this error's .report)",
    ]
    copy = pickle.loads(pickle.dumps(brief))
    assert copy.report == report and copy.ranks == [1] and str(copy) == str(brief)


def test_mismatch_error_lists_every_rank_and_survives_pickling() -> None:
    error = CollectiveMismatchError("all_gather", ["float32[2]", "int64[2]"], hint="fix it")
    assert "rank 0: float32[2]" in str(error) and "rank 1: int64[2]" in str(error)
    assert pickle.loads(pickle.dumps(error)).signatures == ["float32[2]", "int64[2]"]


def _log_as_library(message: str, rank: int | None = None) -> None:
    """Log from a frame whose module is nn_handler.*, as library code does."""
    code = "bound = logger.bind(rank=rank) if rank is not None else logger\nbound.info(message)"
    namespace = {"__name__": "nn_handler.fake", "logger": logger, "rank": rank, "message": message}
    exec(compile(code, "nn_handler/fake.py", "exec"), namespace)


def test_the_library_is_silent_until_the_application_enables_logging(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[str] = []
    everything = logger.add(seen.append, level="DEBUG", format="{message}")
    try:
        _log_as_library("hidden")
        assert seen == [], "nn_handler logs nothing until enabled"
        sink = enable_logging("INFO")
        try:
            _log_as_library("shown on rank 0")
            _log_as_library("not shown: rank 1", rank=1)
        finally:
            disable_logging(sink)
        _log_as_library("silent again")
    finally:
        logger.remove(everything)
    assert [m.strip() for m in seen] == ["shown on rank 0", "not shown: rank 1"]
    err = capsys.readouterr().err
    assert "rank 0 | INFO    | shown on rank 0" in err, err
    assert "not shown" not in err, "other ranks are filtered out by default"


def test_all_ranks_can_be_shown(capsys: pytest.CaptureFixture[str]) -> None:
    sink = enable_logging("INFO", all_ranks=True)
    try:
        _log_as_library("from rank 1", rank=1)
    finally:
        disable_logging(sink)
    assert "rank 1 | INFO    | from rank 1" in capsys.readouterr().err


def test_a_labelled_process_is_named_by_its_label_while_the_label_is_held(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fault-tolerant member (rank 0 of its own, like every member) is named `member m1` in
    its lines while the handle that named it is held; `rank 0` again after."""
    from nn_handler.log import process_name

    named = enable_logging("INFO", label="member m1")
    try:
        _log_as_library("from a member")
        assert process_name(0) == "member m1"
    finally:
        disable_logging(named)
    plain = enable_logging("INFO")
    try:
        _log_as_library("from rank 0")
    finally:
        disable_logging(plain)
    err = capsys.readouterr().err
    assert "| member m1 | INFO    | from a member" in err, err
    assert "| rank 0 | INFO    | from rank 0" in err, err
    assert process_name(0) == "rank 0"


def test_one_line_per_event_while_loguru_default_sink_is_in_place() -> None:
    """loguru's default stderr sink would print every library record a second time (on every
    rank): it is lent to nn_handler's sink while that is on, and given back after."""
    script = textwrap.dedent(
        """
        import sys
        from loguru import logger
        from nn_handler import disable_logging, enable_logging

        def library(message, rank=0):
            code = "logger.bind(rank=rank).info(message)"
            namespace = {"__name__": "nn_handler.fake", "logger": logger,
                         "rank": rank, "message": message}
            exec(compile(code, "nn_handler/fake.py", "exec"), namespace)

        logger.info("app before")
        outer = enable_logging()
        inner = enable_logging(all_ranks=True)
        library("from the library")
        library("rank 1 detail", rank=1)
        logger.info("app during")
        disable_logging(inner)
        disable_logging(outer)
        disable_logging(outer)  # idempotent
        library("after: silent")
        logger.info("app after")
        again = enable_logging()  # a second run in the same process (a notebook, say)
        library("second round")
        logger.info("app again")
        disable_logging(again)
        first, second = enable_logging(), enable_logging()  # two handlers alive at once
        library("shared sink")
        disable_logging(first)
        library("still on")
        disable_logging(second)
        library("off again")
        """
    )
    code, output = run_command([sys.executable, "-c", script], timeout=60)
    assert code == 0, output
    lines = output.splitlines()
    assert sum("app before" in line for line in lines) == 1
    assert sum("app during" in line for line in lines) == 1, output  # one sink, not three
    assert sum("app after" in line for line in lines) == 1, output  # the default is back
    # Each of the two sinks prints the library record once (they were asked twice).
    assert sum("| rank 0 | INFO    | from the library" in line for line in lines) == 2, output
    assert sum("rank 1 detail" in line for line in lines) == 1, output  # the all_ranks sink
    assert "after: silent" not in output
    assert sum("second round" in line for line in lines) == 1, output
    assert sum("app again" in line for line in lines) == 1, output
    assert sum("shared sink" in line for line in lines) == 1, output
    assert sum("still on" in line for line in lines) == 1, output
    assert "off again" not in output


def test_an_application_sink_is_left_alone(capsys: pytest.CaptureFixture[str]) -> None:
    mine: list[str] = []
    own = logger.add(mine.append, format="{message}")
    sink = enable_logging()
    try:
        _log_as_library("to both")
        logger.info("app record")
    finally:
        disable_logging(sink)
        logger.remove(own)
    assert [m.strip() for m in mine] == ["to both", "app record"]
    err = capsys.readouterr().err
    assert err.count("to both") == 1, err
