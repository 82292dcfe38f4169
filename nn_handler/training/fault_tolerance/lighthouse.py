"""The Lighthouse: the coordinator of the fault-tolerance mode. It decides each step's members
from their heartbeats (torchft's Lighthouse, on port N) and records each step's verdict, commit
or abort, once for all of them (a TCPStore on port N+1: the first verdict written stands, so
no member commits a step another abandons). It runs in a process of its own (``nn-handler
lighthouse``, or ``Lighthouse`` starting one), never in a member that can die: with it gone
the members cannot agree on a step and each stops with an error that says so (the run then
restarts from its latest checkpoint)."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from types import TracebackType
from typing import IO, Any, TypeVar

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.engine import (
    TCPStore,
    lighthouse_server,
    require_torchft,
)
from nn_handler.training.fault_tolerance.orphans import ending_with_this_process

T = TypeVar("T")

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
        try:
            store = TCPStore(host, quorum + 1, is_master=True, wait_for_workers=False)
            server = lighthouse_server(
                f"{host}:{quorum}", min_members, join_timeout_s, heartbeat_timeout_s
            )
        except (RuntimeError, OSError) as error:  # a port taken meanwhile
            failure = error
            continue
        print(f"{READY}http://{host}:{quorum}", flush=True)
        serving = (server, store)  # held: they serve until the process ends
        threading.Event().wait()  # until SIGTERM or SIGINT ends the process
        del serving
    raise DistributedError(f"the Lighthouse cannot listen on {host}:{port} and +1: {failure}")


class BoundedStore:
    """The verdicts' store with every request bounded by ``timeout_s``: torch's TCPStore
    client waits without end for a server that accepts and never answers (a Lighthouse
    stopped by SIGSTOP, a host frozen: a vote blocked 76 s and 141 s, until killed), whatever
    its own timeout. A request runs in this store's one daemon thread (never joined at exit:
    one stuck there does not hold the process); one that does not answer in time is a
    TimeoutError, and so is every later one (they queue behind it: the member stops)."""

    def __init__(self, connect: Callable[[], TCPStore], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name="nn_handler-verdicts", daemon=True).start()
        # Connecting is bounded too: a stopped server accepts the connection and never
        # answers the client's first request.
        self.store: TCPStore = self._bounded("connect", connect)

    def close(self) -> None:
        """End the thread once the requests before this one are answered."""
        self._requests.put(None)

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            call, future = request
            try:
                future.set_result(call())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)

    def _bounded(self, what: str, call: Callable[[], T]) -> T:
        future: Future[T] = Future()
        self._requests.put((call, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TimeoutError(
                f"no answer to {what} within {self.timeout_s:g} s (the Lighthouse's host is "
                f"stopped or unreachable)"
            ) from None

    def add(self, key: str, value: int) -> int:
        return self._bounded("add", lambda: int(self.store.add(key, value)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._bounded(
            "compare_set", lambda: bytes(self.store.compare_set(key, expected, desired))
        )

    def check(self, keys: list[str]) -> bool:
        return self._bounded("check", lambda: self.store.check(keys) is True)

    def get(self, key: str) -> bytes:
        return self._bounded("get", lambda: bytes(self.store.get(key)))


def agreed_value(store: BoundedStore, name: str, proposal: str) -> str:
    """The value of ``name`` for the whole run: the first proposal the Lighthouse's store got
    (``proposal`` if this is the first), kept while the Lighthouse lives."""
    return store.compare_set(f"agreed/{name}", "", proposal).decode()


def verdicts_of(lighthouse: str, timeout_s: float) -> BoundedStore:
    """A client of the verdicts' store of the Lighthouse at ``lighthouse``, every request
    bounded by ``timeout_s``."""
    host, port = lighthouse.removeprefix("http://").rsplit(":", 1)
    try:
        return BoundedStore(
            lambda: TCPStore(
                host, int(port) + 1, is_master=False, wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
            ),
            timeout_s,
        )  # fmt: skip
    except (RuntimeError, OSError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise DistributedError(
            f"cannot reach the Lighthouse's verdicts at {host}:{int(port) + 1} within "
            f"{timeout_s:g} s ({first}): is `nn-handler lighthouse --port {port}` running "
            f"there, and is fault_tolerance.lighthouse ({lighthouse}) its address?"
        ) from None


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
    "BoundedStore",
    "Lighthouse",
    "agreed_value",
    "serve",
    "verdicts_of",
]
