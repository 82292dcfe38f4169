"""The error family and rank-aware logging."""

from __future__ import annotations

import pickle

import pytest
from loguru import logger

from nn_handler import enable_logging
from nn_handler.errors import (
    CheckpointError,
    CollectiveMismatchError,
    ConfigError,
    DistributedError,
    NNHandlerError,
    RankFailedError,
)


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
            logger.remove(sink)
            logger.disable("nn_handler")
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
        logger.remove(sink)
        logger.disable("nn_handler")
    assert "rank 1 | INFO    | from rank 1" in capsys.readouterr().err
