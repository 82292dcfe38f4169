"""The nn_handler error family.

Every error the library raises on purpose derives from :class:`NNHandlerError`, and also from the
builtin a caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for a failed
distributed operation), so code written against the seeds' documented builtins keeps working.
Messages say what was expected, what was received, on which rank, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class NNHandlerError(Exception):
    """Root of every error raised by nn_handler."""


class ConfigError(NNHandlerError, ValueError):
    """Invalid configuration or input: a bad environment variable, argument or config field."""


class DistributedError(NNHandlerError, RuntimeError):
    """A distributed operation failed or cannot run (not initialised, bad backend, timeout)."""


class RankFailedError(DistributedError):
    """An operation failed on one or more ranks; raised on every rank so none is left waiting.

    Attributes:
        failed_ranks: the global ranks on which the operation failed, sorted.
        rank_messages: for each failed rank, the original error's type, message and traceback.
    """

    def __init__(self, what: str, rank_messages: Mapping[int, str]) -> None:
        self.what = what
        self.rank_messages: dict[int, str] = dict(sorted(rank_messages.items()))
        self.failed_ranks: list[int] = list(self.rank_messages)
        details = "\n".join(
            f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in self.rank_messages.items()
        )
        super().__init__(f"{what} failed on rank(s) {self.failed_ranks}:\n{details}")

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[str, dict[int, str]]]:
        return (type(self), (self.what, self.rank_messages))


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives, or the same one with incompatible tensors.

    Attributes:
        signatures: what each rank called, by rank.
    """

    def __init__(self, what: str, signatures: Sequence[str], hint: str = "") -> None:
        self.what = what
        self.signatures: list[str] = list(signatures)
        lines = "\n".join(f"  rank {rank}: {sig}" for rank, sig in enumerate(self.signatures))
        message = f"{what}: ranks disagree on the collective call:\n{lines}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[CollectiveMismatchError], tuple[str, list[str]]]:
        return (type(self), (self.what, self.signatures))


class CheckpointError(NNHandlerError, RuntimeError):
    """A checkpoint could not be written or read."""


__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "ConfigError",
    "DistributedError",
    "NNHandlerError",
    "RankFailedError",
]
