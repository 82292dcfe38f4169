"""The Lighthouse: the coordinator of the fault-tolerance mode. It decides each step's members
from their heartbeats (torchft's Lighthouse, on port N) and records each step's verdict, commit
or abort, once for all of them (its verdicts' store on port N+1, verdicts.py: the first
verdict written stands, so no member commits a step another abandons). It runs in a process
of its own (``nn-handler lighthouse``, or ``Lighthouse`` starting one), never in a member that
can die. Killed, it can be started again at the same address (``nn-handler supervise`` does,
``Lighthouse.restart``): the members wait for it up to their ``quorum_timeout_s`` and carry on
through the new one, which learns the quorum from their heartbeats and the run's state from
the members themselves (reconnecting.py); gone for longer, every member stops with an error
that says so (the run then restarts from its latest checkpoint)."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import IO

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.engine import (
    lighthouse_server,
    load_lighthouse,
    require_torchft,
)
from nn_handler.training.fault_tolerance.orphans import ending_with_this_process
from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore

#: The line a Lighthouse process prints first, then its address.
READY = "nn_handler lighthouse listening on "


def serve(
    host: str,
    port: int,
    min_members: int,
    join_timeout_s: float,
    heartbeat_timeout_s: float,
    standby: bool = False,
) -> None:
    """Run the Lighthouse on ``host``:``port`` and its verdicts' store on ``port`` + 1 until
    this process is stopped (``port`` 0: two free ones); prints ``READY`` and its address
    first (torchft names it by the machine's hostname; members dial the host it bound).
    ``standby``: first wait for a line on stdin (its end: return), everything loaded."""
    require_torchft()
    if standby:
        load_lighthouse()  # everything loaded before the wait
        if not sys.stdin.readline():
            return
    # A free port is tried again elsewhere; a given one (a restart) again for a few seconds,
    # while the process that held it ends.
    for _ in range(50):
        quorum = port or _free_port(host)
        store: VerdictServer | None = None
        try:
            store = VerdictServer(host, quorum + 1, heartbeat_timeout_s)
            server = lighthouse_server(
                f"{host}:{quorum}", min_members, join_timeout_s, heartbeat_timeout_s
            )
        except (RuntimeError, OSError) as error:  # a port taken meanwhile
            if store is not None:
                store.close()
            failure = error
            time.sleep(0 if port == 0 else 0.1)
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


def verdicts_of(lighthouse: str, timeout_s: float, wait_s: float = 0.0) -> VerdictStore:
    """A client of the verdicts' store of the Lighthouse at ``lighthouse``, every request
    bounded by ``timeout_s``; its first request made now (a stopped Lighthouse accepts the
    connection and answers nothing), tried again for up to ``wait_s`` (a Lighthouse being
    restarted there: ``nn-handler supervise``'s)."""
    host, port = lighthouse.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            store = VerdictStore(host, int(port) + 1, timeout_s)
        except OSError as error:
            failure = error
        else:
            try:
                store.check([])
                return store
            except OSError as error:
                store.close()
                failure = error
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"cannot reach the Lighthouse's verdicts at {host}:{int(port) + 1} within "
                f"{max(timeout_s, wait_s):g} s ({failure or type(failure).__name__}): is "
                f"`nn-handler lighthouse --port {port}` running there, and is "
                f"fault_tolerance.lighthouse ({lighthouse}) its address?"
            ) from None
        time.sleep(0.1)


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
        standby: keep a second process loaded beside it, that ``restart`` starts listening
            at once (0.1 s, not the 1.5 s of a new interpreter that imports torch).
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
        standby: bool = False,
    ) -> None:
        require_torchft()
        self._settings = (host, min_members, join_timeout_s, heartbeat_timeout_s)
        self.start_timeout_s = start_timeout_s
        self._process = self._start(port)
        self._spare: subprocess.Popen[str] | None = None
        line = _first_line(self._process.stdout, start_timeout_s)
        if not line.startswith(READY):
            self.kill()
            raise DistributedError(
                f"the Lighthouse did not start on {host}:{port} within {start_timeout_s:g} s "
                f"(exit {self._process.poll()}; its errors are above)."
            )
        self.address = line[len(READY) :].strip()
        self.port = int(self.address.rsplit(":", 1)[1])
        if standby:
            self._spare = self._start(self.port, standby=True)

    def _start(self, port: int, standby: bool = False) -> subprocess.Popen[str]:
        host, min_members, join_timeout_s, heartbeat_timeout_s = self._settings
        command = [sys.executable, "-m", "nn_handler.cli", "lighthouse", "--host", host,
                   "--port", str(port), "--min-members", str(min_members),
                   "--join-timeout-s", str(join_timeout_s),
                   "--heartbeat-timeout-s", str(heartbeat_timeout_s)]  # fmt: skip
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        # (preexec_fn: not left running if this process is killed)
        return subprocess.Popen(
            [*command, "--standby"] if standby else command,
            stdin=subprocess.PIPE if standby else None, stdout=subprocess.PIPE, text=True,
            env=env, preexec_fn=ending_with_this_process(),
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        """Its exit status once it ended (None while it runs)."""
        return self._process.poll()

    def restart(self) -> None:
        """Start it again at the same address, once it ended (killed, or its process lost):
        the members carry on through the new one (reconnecting.py). A DistributedError if
        it does not listen there within ``start_timeout_s``."""
        if self._process.poll() is None:
            raise DistributedError(f"the Lighthouse at {self.address} still runs: not restarted")
        if self._process.stdout is not None:
            self._process.stdout.close()
        spare, self._spare = self._spare, None
        if spare is not None and spare.poll() is None and spare.stdin is not None:
            spare.stdin.write("\n")  # listen now
            spare.stdin.flush()
            self._process = spare
        else:
            self._process = self._start(self.port)
        line = _first_line(self._process.stdout, self.start_timeout_s)
        if line.strip() != f"{READY}{self.address}":
            self.kill()
            raise DistributedError(
                f"the Lighthouse did not start again at {self.address} within "
                f"{self.start_timeout_s:g} s (exit {self._process.poll()}; its errors are "
                f"above): the members stop once their quorum_timeout_s passes."
            )
        if spare is not None:
            self._spare = self._start(self.port, standby=True)

    def close(self) -> None:
        """Stop it and its spare (members then fail their next quorum). Idempotent."""
        if self._spare is not None:
            self._spare.kill()  # it never listened: nothing to end cleanly
            self._spare.wait()
            for stream in (self._spare.stdin, self._spare.stdout):
                if stream is not None:
                    stream.close()
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
