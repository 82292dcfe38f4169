"""The nn_handler error family.

Every error the library raises on purpose derives from ``NNHandlerError``, and also from the
builtin a caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for a failed
distributed operation), so code written against the seeds' documented builtins keeps working.
Messages say what was expected, what was received, on which rank, and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any


class NNHandlerError(Exception):
    """Root of every error raised by nn_handler."""


class ConfigError(NNHandlerError, ValueError):
    """Invalid configuration or input: a bad environment variable, argument or config field."""


class UnevenDataError(ConfigError):
    """The ranks' training loaders have different numbers of batches (raised on every rank
    alike, before the epoch's first step, naming each rank's length)."""


class DistributedError(NNHandlerError, RuntimeError):
    """A distributed operation failed or cannot run (not initialised, bad backend, timeout)."""


class WorkerFailedError(DistributedError):
    """Work failed in one or more worker processes (ranks or devices); raised so none is lost.

    Attributes:
        failed: for each failed worker (by index), its error's type, message and traceback.
        unit: what a worker index means ('rank' or 'device').
        brief: whether the message names each failure in one line (its error and innermost
            line) because the whole traceback is printed elsewhere (by the failed rank itself,
            or as this error's cause); ``failed`` holds the whole texts either way.
    """

    def __init__(
        self,
        what: str,
        messages: Mapping[int, str],
        unit: str = "worker",
        note: str = "",
        brief: bool = False,
    ) -> None:
        self.what = what
        self.unit = unit
        self.note = note
        self.brief = brief
        self.failed: dict[int, str] = dict(sorted(messages.items()))
        if brief:
            details = "\n".join(
                f"--- {unit} {index} --- {summarize_traceback(text)} (the traceback: "
                f"{unit} {index}'s output, or .rank_messages)"
                for index, text in self.failed.items()
            )
        else:
            details = "\n".join(
                f"--- {unit} {index} ---\n{text.rstrip()}" for index, text in self.failed.items()
            )
        message = f"{what} failed on {unit}(s) {list(self.failed)}:\n{details}"
        super().__init__(message + (f"\n{note}" if note else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_worker_error,
            (type(self), self.what, self.failed, self.unit, self.note, self.brief),
        )


def _rebuild_worker_error(
    cls: type[WorkerFailedError],
    what: str,
    failed: dict[int, str],
    unit: str,
    note: str,
    brief: bool = False,
) -> WorkerFailedError:
    error = cls.__new__(cls)
    WorkerFailedError.__init__(error, what, failed, unit, note, brief)
    return error


def summarize_traceback(text: str) -> str:
    """A formatted traceback in one line: its (last) error and the innermost line it names,
    e.g. ``KeyError: 'x' at train.py:11 in __getitem__``, after what precedes the traceback
    (how a rank left). Text that is not a traceback (a rank killed by a signal) comes back as
    it is, on one line."""
    lines = text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return " ".join(line.strip() for line in lines)
    last = frames[-1]
    error = [line for line in lines[last + 1 :] if line and not line.startswith("    ")]
    frame = re.match(r'\s*File "(.*)", line (\d+), in (.*)', lines[last])
    where = f"{frame[1]}:{frame[2]} in {frame[3]}" if frame else lines[last].strip()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), 0)
    preamble = "".join(f"{line.strip()}: " for line in lines[:start] if line.strip())
    return f"{preamble}{' '.join(error[:3]) or '(no message)'} at {where}"


class RankFailedError(WorkerFailedError):
    """An operation failed on one or more ranks; raised on every rank so none is left waiting.

    Attributes:
        failed_ranks: the ranks on which the operation failed, sorted.
        rank_messages: for each failed rank, the original error's type, message and traceback
            (whole, also where the message is ``brief``: one line per failed rank, because
            each failed rank prints its own traceback).
    """

    def __init__(
        self, what: str, rank_messages: Mapping[int, str], note: str = "", brief: bool = False
    ) -> None:
        super().__init__(what, rank_messages, unit="rank", note=note, brief=brief)

    @property
    def failed_ranks(self) -> list[int]:
        return list(self.failed)

    @property
    def rank_messages(self) -> dict[int, str]:
        return self.failed


class PeerLostError(DistributedError):
    """A member of the step's group was lost (killed, or silent past the timeout) during a
    collective of the fault-tolerance mode: the step is abandoned, not committed, and redone
    by the members left."""


class LauncherGoneError(DistributedError):
    """This worker's launcher (torchrun's agent) is gone: the worker stops at its next step,
    writes nothing more and exits non-zero, instead of training on as an orphan beside a
    relaunched job. Each worker finds it by itself (no agreement is needed)."""


class WorkerTimeoutError(DistributedError):
    """Worker processes were still running at a deadline and were killed.

    Attributes:
        running: indices of the workers that were still running.
        stacks: the Python stacks each of them dumped before it was killed.
    """

    def __init__(
        self, what: str, running: Sequence[int], stacks: Mapping[int, str], unit: str = "rank"
    ) -> None:
        self.what = what
        self.running = list(running)
        self.stacks = dict(stacks)
        self.unit = unit
        dumps = "\n".join(
            f"--- {unit} {index} ---\n{self.stacks.get(index, '(no stack dumped)').rstrip()}"
            for index in self.running
        )
        super().__init__(
            f"{what} passed its deadline; {unit}(s) {self.running} were still running and were "
            f"killed. Where they were:\n{dumps}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.running, self.stacks, self.unit))


class CollectiveMismatchError(DistributedError):
    """Ranks called different collectives, or the same one with incompatible tensors.

    Attributes:
        signatures: what each rank called, by rank.
    """

    def __init__(self, what: str, signatures: Sequence[str], hint: str = "") -> None:
        self.what = what
        self.hint = hint
        self.signatures: list[str] = list(signatures)
        lines = "\n".join(f"  rank {rank}: {sig}" for rank, sig in enumerate(self.signatures))
        message = f"{what}: ranks disagree on the collective call:\n{lines}"
        if hint:
            message += f"\n{hint}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[CollectiveMismatchError], tuple[str, list[str], str]]:
        return (type(self), (self.what, self.signatures, self.hint))


class CollectiveStallError(DistributedError):
    """A rank waited in a collective longer than the stall timeout: raised on every rank by
    the stall watchdog with one report (which ranks have not arrived, each rank's last
    collective and line, the stacks of the ranks still running).

    Attributes:
        report: the whole report.
        ranks: the ranks that had not arrived (or did not answer).
        printed_by: the rank that printed the whole report when it found the stall (the
            message is then the report's first line), or None (the message is the report).
    """

    def __init__(
        self, report: str, ranks: Sequence[int] = (), printed_by: int | None = None
    ) -> None:
        self.report = report
        self.ranks: list[int] = list(ranks)
        self.printed_by = printed_by
        if printed_by is None:
            super().__init__(report)
        else:
            headline = report.splitlines()[0] if report else ""
            super().__init__(
                f"{headline}\n(the whole report, with each rank's state and stack, was printed "
                f"by rank {printed_by} when it found the stall; it is also this error's .report)"
            )

    def __reduce__(
        self,
    ) -> tuple[type[CollectiveStallError], tuple[str, list[int], int | None]]:
        return (type(self), (self.report, self.ranks, self.printed_by))


class LocalGroupSizeError(ConfigError, AssertionError):
    """``create_local_process_group``: the world size is not a multiple of
    num_workers_per_machine, or a local group of another size exists. Also an AssertionError,
    which detectron2's ``comm`` (seed 000) raised for both, so callers catching that keep
    working."""


class NoLocalGroupError(DistributedError, AssertionError):
    """``get_local_process_group`` in a distributed run before ``create_local_process_group``.
    Also an AssertionError, as in detectron2's ``comm`` (seed 000)."""


class NonFiniteError(NNHandlerError, FloatingPointError):
    """The loss or the gradients were NaN/inf before an optimizer step (raised on every rank
    alike, when TrainerConfig(nonfinite='raise'))."""


class CheckpointError(NNHandlerError, RuntimeError):
    """A checkpoint could not be written or read (the message names the path and the cause)."""


class HandlerClosedError(NNHandlerError, RuntimeError):
    """An NNHandler was used after ``close()`` (or the end of its ``with`` block), which left
    its process group."""


PREEMPTED_EXIT_CODE = 75
#: The exit status of a run stopped by Ctrl-C (128 + SIGINT, what a shell reports for it).
INTERRUPTED_EXIT_CODE = 130
"""The exit status of a run stopped by SIGTERM after its emergency checkpoint (EX_TEMPFAIL:
"try again"; relaunching resumes from that checkpoint)."""


class TrainingPreempted(SystemExit):
    """Training stopped on SIGTERM after every rank agreed and the checkpoint was written.

    A ``SystemExit`` (not an ``Exception``), so an uncaught one ends the process quietly with
    status ``PREEMPTED_EXIT_CODE`` (or the configured code) instead of a traceback.

    Attributes:
        checkpoint: the emergency checkpoint's path (on an object store its URL, where it
            lives, not the local working copy; None when it could not be written in time).
        global_step: the optimizer steps completed before stopping.
    """

    def __init__(self, code: int, checkpoint: str | None, global_step: int) -> None:
        super().__init__(code)
        self.checkpoint = checkpoint
        self.global_step = global_step

    def __str__(self) -> str:
        where = self.checkpoint or "no checkpoint (it did not finish in time)"
        return f"preempted after optimizer step {self.global_step}; saved {where}"

    def __reduce__(self) -> Any:
        return (type(self), (self.code, self.checkpoint, self.global_step))


class TrainingInterrupted(TrainingPreempted):
    """Training stopped on Ctrl-C (SIGINT) after every rank agreed and the checkpoint was
    written: a TrainingPreempted whose status is ``INTERRUPTED_EXIT_CODE``. A second
    Ctrl-C raises a plain KeyboardInterrupt at once instead."""

    def __init__(
        self, checkpoint: str | None, global_step: int, code: int = INTERRUPTED_EXIT_CODE
    ) -> None:
        super().__init__(code, checkpoint, global_step)

    def __str__(self) -> str:
        where = self.checkpoint or "no checkpoint (it did not finish in time)"
        return f"interrupted (Ctrl-C) after optimizer step {self.global_step}; saved {where}"

    def __reduce__(self) -> Any:
        return (type(self), (self.checkpoint, self.global_step, self.code))


class RunFinished(SystemExit):
    """A member of a fault-tolerant run started after the run's last step was committed:
    there is nothing left to train. A ``SystemExit`` with status 0, so an uncaught one ends
    the process quietly and a supervisor does not restart it.

    Attributes:
        member: the member's id.
        step: the run's last committed step.
        lighthouse: the address of the run's Lighthouse.
    """

    def __init__(self, member: str, step: int, lighthouse: str) -> None:
        super().__init__(0)
        self.member, self.step, self.lighthouse = member, step, lighthouse

    def __str__(self) -> str:
        return (
            f"member {self.member}: the run of the Lighthouse at {self.lighthouse} finished "
            f"(its last step, {self.step}, is committed) before this member joined it; "
            f"nothing to train: it leaves"
        )

    def __reduce__(self) -> Any:
        return (type(self), (self.member, self.step, self.lighthouse))


__all__ = [
    "CheckpointError",
    "HandlerClosedError",
    "CollectiveMismatchError",
    "CollectiveStallError",
    "ConfigError",
    "DistributedError",
    "LauncherGoneError",
    "INTERRUPTED_EXIT_CODE",
    "LocalGroupSizeError",
    "NNHandlerError",
    "NoLocalGroupError",
    "NonFiniteError",
    "PREEMPTED_EXIT_CODE",
    "PeerLostError",
    "RankFailedError",
    "RunFinished",
    "TrainingInterrupted",
    "TrainingPreempted",
    "UnevenDataError",
    "WorkerFailedError",
    "WorkerTimeoutError",
]
