"""Run a Python script the way ``python script.py`` does, in a process forked from the harness's
preloaded forkserver instead of a fresh interpreter.

A fresh interpreter spends about 2 s of CPU importing torch and nn_handler before the script's
first line; a process forked from the forkserver that already imported them (``PRELOAD`` in
tests/harness.py) starts in milliseconds. For the scripts that tests start by hand (ranks
without a launcher, a job that is killed, a CLI run), the difference is invisible to the
script:

- ``sys.argv``, ``__main__``, ``__file__`` and ``sys.path[0]`` (the script's folder, or the
  working directory for ``-m``) are what the interpreter would set; ``PYTHONPATH`` entries of
  the given environment come next;
- the environment is exactly the given one (the forkserver's own is cleared), the working
  directory the given one, the process its own session (a kill reaches what it started);
- stdout and stderr go, interleaved, to one file that the caller reads back, stderr line
  buffered and stdout unbuffered when ``PYTHONUNBUFFERED`` is set, as in the interpreter;
- the exit status follows the interpreter's rules: ``sys.exit(n)``, 1 with the traceback for
  an uncaught exception (the runner's own frames left out), death by SIGINT for an uncaught
  KeyboardInterrupt, a signal's negative number when killed; non-daemon threads are joined
  and ``atexit`` functions run before the process leaves;
- multiprocessing's start method is the interpreter's default, not the forkserver's, so the
  processes a script starts (DataLoader workers) fork as they would from a fresh interpreter.

What cannot be checked this way stays a fresh interpreter: what a user's first import costs
or loads (tests/unit/test_strategy.py), memory peaks (the preloaded modules are resident),
the examples and the README as users run them, and everything under torchrun, whose ranks the
real torchrun starts.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from tests.harness import PRELOAD, GroupRunError
from tests.timeouts import scaled


@dataclass(frozen=True)
class Script:
    """``python <path> <args>`` (or ``python -m <module> <args>``) with ``env`` added to the
    caller's environment."""

    path: str | Path = ""
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    module: str = ""

    def __str__(self) -> str:
        target = f"-m {self.module}" if self.module else str(self.path)
        return " ".join(["python", target, *self.args])


def _runner_frames_dropped(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in {__name__, "runpy"}:
        tb = tb.tb_next
    return tb


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run(script: Script, env: dict[str, str], cwd: str | None, output: str, error: str) -> None:
    """The forked child: become ``python script``, then leave as the interpreter would."""
    os.setsid()
    for stream, path in ((1, output), (2, error)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, stream)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    # A forkserver's child would start its own processes (a DataLoader's workers) through a
    # forkserver of its own, a fresh interpreter each; the script's start as the interpreter's.
    mp.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.stdout.reconfigure(write_through=bool(env.get("PYTHONUNBUFFERED")))  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    extra = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    code, interrupted = 0, False
    try:
        if script.module:
            sys.argv = [script.module, *script.args]
            sys.path[:0] = [os.getcwd(), *extra]
            runpy.run_module(script.module, run_name="__main__", alter_sys=True)
        else:
            path = str(Path(script.path).resolve())
            sys.argv = [str(script.path), *script.args]
            sys.path[:0] = [str(Path(path).parent), *extra]
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # what the interpreter prints for an uncaught exception
        exc.with_traceback(_runner_frames_dropped(exc.__traceback__))  # printed from exc's own
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter: join threads,
    atexit._run_exitfuncs()  # then the atexit functions
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # the interpreter then dies by SIGINT, so that its parent knows
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run_all(
    scripts: Sequence[Script],
    timeout: float,
    env: Mapping[str, str] | None,
    cwd: str | Path | None,
    split: bool,
) -> list[tuple[int, str, str]]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    where = None if cwd is None else str(cwd)
    with tempfile.TemporaryDirectory(prefix="nnh-scripts-") as tmp:
        files = [
            (Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err" if split else f"{i}.out"))
            for i in range(len(scripts))
        ]
        procs = []
        for script, (output, error) in zip(scripts, files, strict=True):
            output.touch()
            error.touch()
            child_env = {**base, **script.env}
            proc = ctx.Process(
                target=_run, args=(script, child_env, where, str(output), str(error))
            )
            proc.start()
            procs.append(proc)
        bound = scaled(timeout)
        end = time.monotonic() + bound
        for proc in procs:
            proc.join(max(0.1, end - time.monotonic()))
        if any(proc.exitcode is None for proc in procs):
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.join(5)
            texts = [
                f"--- {script} ---\n{output.read_text()}{error.read_text() if split else ''}"
                for script, (output, error) in zip(scripts, files, strict=True)
            ]
            raise GroupRunError(
                f"scripts passed {bound:.0f}s and were killed:\n" + "\n".join(texts)
            )
        return [
            (proc.exitcode or 0, output.read_text(), error.read_text() if split else "")
            for proc, (output, error) in zip(procs, files, strict=True)
        ]


def run_scripts(
    scripts: Sequence[Script],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> list[tuple[int, str]]:
    """Run ``scripts`` concurrently, each forked from the preloaded forkserver in its own
    session, all bounded by ``timeout`` seconds; (exit code, output) for each, as
    tests.harness.run_commands gives for the same command lines (stdout and stderr
    interleaved in one output).

    On timeout every session is killed and the test fails with each script's output so far.
    """
    return [(code, output) for code, output, _ in _run_all(scripts, timeout, env, cwd, False)]


def run_script(
    script: Script,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[int, str]:
    """One script, as :func:`run_scripts` runs it; (exit code, output)."""
    return run_scripts([script], timeout=timeout, env=env, cwd=cwd)[0]


def run_script_split(
    script: Script,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[int, str, str]:
    """One script, as :func:`run_script` runs it, its streams apart: (exit code, stdout,
    stderr), as ``subprocess.run(..., capture_output=True)`` gives them."""
    return _run_all([script], timeout, env, cwd, True)[0]


__all__ = ["Script", "run_script", "run_script_split", "run_scripts"]
