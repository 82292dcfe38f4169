"""The Lighthouse: the coordinator of the fault-tolerance mode. It decides each step's members
from their heartbeats (torchft's Lighthouse, on port N) and records each step's verdict, commit
or abort, once for all of them (its verdicts' store on port N+1, verdicts.py: the first
verdict written stands, so no member commits a step another abandons). It runs in a process
of its own (``nn-handler lighthouse``, or ``Lighthouse`` starting one), never in a member that
can die: with it gone the members cannot agree on a step and each stops with an error that
says so (the run then restarts from its latest checkpoint)."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from types import TracebackType
from typing import IO

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.engine import lighthouse_server, require_torchft
from nn_handler.training.fault_tolerance.orphans import ending_with_this_process
from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore

#: The line a Lighthouse process prints first, then its address.
READY = "nn_handler lighthouse listening on "


def serve(
    host: str, port: int, min_members: int, join_timeout_s: float, heartbeat_timeout_s: float
) -> None:
    """Run the Lighthouse on ``host``:``port`` and its verdicts' store on ``port`` + 1 until
    this process is stopped (``port`` 0: two free ones); prints ``READY`` and its address
    first (torchft names it by the machine's hostname; members dial the host it bound)."""
    require_torchft()
    for _ in range(50 if port == 0 else 1):
        quorum = port or _free_port(host)
        store: VerdictServer | None = None
        try:
            store = VerdictServer(host, quorum + 1)
            server = lighthouse_server(
                f"{host}:{quorum}", min_members, join_timeout_s, heartbeat_timeout_s
            )
        except (RuntimeError, OSError) as error:  # a port taken meanwhile
            if store is not None:
                store.close()
            failure = error
            continue
        print(f"{READY}http://{host}:{quorum}", flush=True)
        serving = (server, store)  # held: they serve until the process ends
        threading.Event().wait()  # until SIGTERM or SIGINT ends the process
        del serving
    raise DistributedError(f"the Lighthouse cannot listen on {host}:{port} and +1: {failure}")


def agreed_value(store: VerdictStore, name: str, proposal: str) -> str:
    """The value of ``name`` for the whole run: the first proposal the Lighthouse's store got
    (``proposal`` if this is the first), kept while the Lighthouse lives."""
    return store.compare_set(f"agreed/{name}", "", proposal).decode()


def verdicts_of(lighthouse: str, timeout_s: float) -> VerdictStore:
    """A client of the verdicts' store of the Lighthouse at ``lighthouse``, every request
    bounded by ``timeout_s``; its first request made now (a stopped Lighthouse accepts the
    connection and answers nothing)."""
    host, port = lighthouse.removeprefix("http://").rsplit(":", 1)
    try:
        store = VerdictStore(host, int(port) + 1, timeout_s)
        store.check([])
    except OSError as error:
        raise DistributedError(
            f"cannot reach the Lighthouse's verdicts at {host}:{int(port) + 1} within "
            f"{timeout_s:g} s ({error or type(error).__name__}): is `nn-handler lighthouse "
            f"--port {port}` running there, and is fault_tolerance.lighthouse ({lighthouse}) "
            f"its address?"
        ) from None
    return store


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Lighthouse:
    """A Lighthouse in a child process, listening on ``host`` (``port`` 0: a free one).

    Args:
        min_members: the fewest members a step may have.
        join_timeout_s: how long a step's quorum waits for a live member (one that sends
            heartbeats) to ask for it: a slow member is waited for, not left out (a dead one
            is dropped once its heartbeats stop). torchft's default, 60 s.
        heartbeat_timeout_s: a member silent that long is left out of the next step.
        start_timeout_s: how long it may take to start.
    Its log is the child's stderr (this process's); torchft's per-step lines are left out
    unless ``RUST_LOG`` asks for them. It ends with the thread that made it (on Linux also
    when this process is SIGKILLed: ``orphans.ending_with_this_process``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        min_members: int = 1,
        join_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 1.0,
        start_timeout_s: float = 30.0,
    ) -> None:
        require_torchft()
        command = [sys.executable, "-m", "nn_handler.cli", "lighthouse", "--host", host,
                   "--port", str(port), "--min-members", str(min_members),
                   "--join-timeout-s", str(join_timeout_s),
                   "--heartbeat-timeout-s", str(heartbeat_timeout_s)]  # fmt: skip
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env=env,
            preexec_fn=ending_with_this_process(),  # not left running if this one is killed
        )  # fmt: skip
        line = _first_line(self._process.stdout, start_timeout_s)
        if not line.startswith(READY):
            self.kill()
            raise DistributedError(
                f"the Lighthouse did not start on {host}:{port} within {start_timeout_s:g} s "
                f"(exit {self._process.poll()}; its errors are above)."
            )
        self.address = line[len(READY) :].strip()
        self.port = int(self.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        """Stop it (members then fail their next quorum). Idempotent."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def kill(self) -> None:
        """SIGKILL it, as a lost machine would."""
        self._process.kill()
        self._process.wait()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _first_line(stream: IO[str] | None, timeout_s: float) -> str:
    """The first line of ``stream`` ('' at its end or after ``timeout_s``)."""
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: lines.put(stream.readline() if stream is not None else ""), daemon=True
    )
    reader.start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return ""


__all__ = [
    "READY",
    "Lighthouse",
    "agreed_value",
    "serve",
    "verdicts_of",
]
