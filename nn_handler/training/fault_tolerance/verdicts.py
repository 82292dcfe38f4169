"""The verdicts' store: the few keys a run's members agree through (each step's votes and
verdict, its place in the data, the run's id and fingerprint), kept by the Lighthouse's
process on its port + 1 and read by every member.

A step's agreement is one request a member (``vote``): the server counts the votes, decides
the verdict once (commit when every member voted done at the same place in the data, abort at
the first failure, a place that differs, or a vote missing after the wait) and answers every
voter when it is decided, with whether the next step must agree on its members again (after an
abort, or when a member asked to join since the last commit: ``JOINS``). A failure-free step
costs one round trip to the store and no quorum.

A key-value store over one TCP connection per member, in Python: every request is bounded by
the socket's timeout, including the connection (a stopped host accepts it and never
answers), and a server that is gone is one OSError in the member, not torch's C++ warning
with its stack frames on stderr (TCPStore, which this replaced, printed one per request).
One request a line of JSON, one answer a line of JSON. Loading never runs code."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from nn_handler.training.fault_tolerance.pulses import Pulses

#: How long the server waits for a key a ``get`` asks for before it answers without it.
GET_WAIT_S = 30.0
#: The counter a member adds 1 to before it asks to join the run's members.
JOINS = "joins"
#: The run's last committed step, once a member finished the run (Replica.finish).
FINISHED = "finished"
#: The latest step committed (its number): a later attempt of it, or of a step before it, is
#: an abort (members that missed the run's steps, e.g. new ones alone in a quorum, never
#: commit a step twice nor start the run again), and a quorum behind it waits (Replica).
COMMITTED = "committed"
#: This store's own name, new in each Lighthouse process: torchft's quorum ids count again
#: from 1 in a restarted one, and a group named by its quorum id alone could meet the keys of
#: an earlier group of the same id (the addresses of members long gone).
LIFE = "life"
#: How much longer than the server's wait for the votes a voter waits for its answer.
VOTE_MARGIN_S = 5.0
#: What ``Verdicts.answer`` returns for a vote already answered through its ``reply``.
ANSWERED = object()
#: A member silent this long on its pulse is gone, unless the server is told otherwise.
HEARTBEAT_TIMEOUT_S = 1.0


class Verdicts:
    """The store's values and its whole logic (``answer``), under one lock: the server's, or
    a test's in one process. Loading never runs code (strings and integers only). A member
    silent on its pulse for ``heartbeat_timeout_s`` is gone (pulses.py)."""

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.values: dict[str, str] = {LIFE: secrets.token_hex(6)}
        self.changed = threading.Condition()
        self.pulses = Pulses(self.changed, heartbeat_timeout_s)
        #: The voters of each attempt still waiting, by how to answer them.
        self._waiting: dict[str, list[Callable[[Any], None]]] = {}

    def answer(self, op: str, args: list[Any], reply: Callable[[Any], None] | None = None) -> Any:
        """The answer to one request. With ``reply`` (a server's: writes an answer to this
        request's member), a vote still waiting when its verdict is decided is answered
        through it by the request that decides it, at once (no thread to wake per voter),
        and its own call returns ``ANSWERED``."""
        with self.changed:
            values = self.values
            if op == "add":
                key, amount = str(args[0]), int(args[1])
                values[key] = str(int(values.get(key, "0")) + amount)
                self.changed.notify_all()
                return int(values[key])
            if op == "compare_set":
                key, expected, desired = (str(a) for a in args)
                current = values.get(key)
                if current is None and expected != "":
                    return expected
                if current is None or current == expected:
                    values[key] = desired
                    self.changed.notify_all()
                    return desired
                return current
            if op == "check":
                return all(str(key) in values for key in args[0])
            if op == "value":  # at once: ``args[1]`` for a key not set
                return values.get(str(args[0]), str(args[1]))
            if op == "get":
                key = str(args[0])
                self.changed.wait_for(lambda: key in values, timeout=GET_WAIT_S)
                return values[key]
            if op == "vote":
                leaving = len(args) > 5 and args[5] is True  # JSON's true, nothing else
                voter = str(args[6]) if len(args) > 6 else ""
                return self._vote(str(args[0]), int(args[1]), args[2] is True, str(args[3]),
                                  float(args[4]), leaving, voter, reply)  # fmt: skip
            if op == "restore":
                return self._restore({str(key): str(value) for key, value in args[0].items()})
            if op == "pulse":
                return self.pulses.pulse(str(args[0]), int(args[1]))
            if op == "leave":
                return self.pulses.leave(str(args[0]))
            if op == "abort_missing":
                ranks = int(args[2]) if len(args) > 2 else 1
                return self._abort_missing(str(args[0]), str(args[1]), ranks)
            raise KeyError(f"no request {op!r}")

    def _restore(self, known: dict[str, str]) -> list[str]:
        """What a member knows of the run, told to a store that may have restarted (a new
        Lighthouse process: ``ReconnectingVerdicts``): each key not set is set; the run's
        agreed values (``agreed/``) are set whatever this store holds (a member of the run
        knows them, a joiner may have proposed its own first); a verdict set makes its
        attempt decided (its voters still waiting are answered). The answer: the keys whose
        value here differs from the member's (a verdict that differs: that member left the
        run's bits). Called under the lock."""
        values, differing = self.values, []
        for key, value in known.items():
            if key.startswith("agreed/"):
                values[key] = value
            elif values.setdefault(key, value) != value:
                differing.append(key)
        for key in known:
            attempt = key.removesuffix("/verdict")
            if key.endswith("/verdict") and values[key] == "commit":
                self._committed(attempt)
            if key.endswith("/verdict") and f"{attempt}/position" in values:
                self._decided(attempt)
        self.changed.notify_all()
        return differing

    def _vote(
        self,
        attempt: str,
        members: int,
        done: bool,
        position: str,
        wait_s: float,
        leaving: bool,
        voter: str,
        reply: Callable[[Any], None] | None,
    ) -> Any:
        """One member's vote on ``attempt`` (``step/quorum/attempt``) of a step of ``members``
        members (``leaving``: it leaves the run after this step, preempted; ``voter``: its
        name, so that a vote sent again after a lost connection is counted once); waits up to
        ``wait_s`` for the verdict (then decides abort). The answer: [verdict, the run's place
        in the data (the first voter's), whether the next step agrees on its members: after an
        abort, a join asked since the last commit, or a member leaving]. Called under the
        lock."""
        values, verdict = self.values, f"{attempt}/verdict"
        run_position = values.setdefault(f"{attempt}/position", position)
        if leaving:
            values[f"{attempt}/leaving"] = "True"
        if not done or position != run_position or _step(attempt) <= self.committed():
            values.setdefault(verdict, "abort")
        else:
            votes, counted = int(values.get(f"{attempt}/done", "0")), f"{attempt}/done/{voter}"
            if not voter or counted not in values:  # a vote sent again is counted once
                votes += 1
                values[f"{attempt}/done"] = str(votes)
                values[counted] = "True"
            if votes >= members and verdict not in values:
                values[verdict] = "commit"
                self._committed(attempt)
                joins = values.get(JOINS, "0")  # a join asked since the last commit: agree
                changed = joins != values.get(f"{JOINS}/seen", "0")
                values[f"{attempt}/quorum_next"] = str(changed or f"{attempt}/leaving" in values)
                values[f"{JOINS}/seen"] = joins
        if verdict in values:
            return self._decided(attempt)
        waiting = self._waiting.setdefault(attempt, [])
        if reply is not None:
            waiting.append(reply)
        if not self.changed.wait_for(lambda: verdict in values, timeout=wait_s):
            values[verdict] = "abort"  # a member gone before its vote
            if reply is not None:
                waiting.remove(reply)  # this request answers for itself
            return self._decided(attempt)
        return ANSWERED if reply is not None else self._verdict_of(attempt)

    def _abort_missing(self, attempt: str, member: str, ranks: int = 1) -> bool:
        """``member`` of ``attempt`` is gone: abort it unless it is decided or ``member``
        voted done on it with each of its ``ranks`` (its collectives finished); whether its
        verdict is abort. Called under the lock."""
        values, verdict = self.values, f"{attempt}/verdict"
        voters = [member] if ranks == 1 else [f"{member}/{rank}" for rank in range(ranks)]
        if verdict not in values and any(f"{attempt}/done/{v}" not in values for v in voters):
            values[verdict] = "abort"
            if f"{attempt}/position" in values:  # its voters waiting are answered
                self._decided(attempt)
            else:  # no vote yet: the first voter's place is the run's, as in any attempt
                self.changed.notify_all()
        return values.get(verdict) == "abort"

    def committed(self) -> int:
        """The latest step committed (-1: none)."""
        return int(self.values.get(COMMITTED, "-1"))

    def _committed(self, attempt: str) -> None:
        """``attempt`` (``step/quorum/attempt``) was committed."""
        self.values[COMMITTED] = str(max(self.committed(), _step(attempt)))

    def _decided(self, attempt: str) -> list[Any]:
        """The verdict of ``attempt``, just decided or read: every voter still waiting is
        answered (then woken), and this request's answer returned."""
        answer = self._verdict_of(attempt)
        for reply in self._waiting.pop(attempt, []):
            reply(answer)
        self.changed.notify_all()
        return answer

    def _verdict_of(self, attempt: str) -> list[Any]:
        values = self.values
        verdict, position = values[f"{attempt}/verdict"], values[f"{attempt}/position"]
        again = verdict != "commit" or values.get(f"{attempt}/quorum_next") == "True"
        return [verdict, position, again]


def _step(attempt: str) -> int:
    """The step of ``attempt`` (``step/quorum/attempt``; -1: a name that holds none)."""
    first = attempt.split("/", 1)[0]
    return int(first) if first.isdigit() else -1


class VerdictStore:
    """A client of the verdicts' store at ``host``:``port``; every request (and the
    connection) bounded by ``timeout_s``: a TimeoutError, and every request after it too
    (the connection's state is unknown). A store that is gone: an OSError."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken: OSError | None = None
        self._socket = socket.create_connection((host, port), timeout=timeout_s)
        self._reader = self._socket.makefile("rb")

    def _request(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._broken is not None:
                raise self._broken
            try:
                self._socket.sendall(json.dumps([op, *args]).encode() + b"\n")
                line = self._reader.readline()
            except TimeoutError:
                self._broken = TimeoutError(
                    f"no answer to {op} within {self.timeout_s:g} s (the Lighthouse's host is "
                    f"stopped or unreachable)"
                )
                raise self._broken from None
            except OSError as error:
                self._broken = error
                raise
            if not line:
                self._broken = ConnectionError("the verdicts' store closed the connection")
                raise self._broken
            answer = json.loads(line)
            if "error" in answer:
                raise OSError(f"the verdicts' store refused {op}: {answer['error']}")
            return answer["value"]

    def add(self, key: str, value: int) -> int:
        """``key``'s integer plus ``value`` (from 0), kept; the new value."""
        return int(self._request("add", key, value))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if it is not set);
        the value it holds afterwards (``expected`` for a key not set, with another one)."""
        return str(self._request("compare_set", key, expected, desired)).encode()

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set."""
        return self._request("check", keys) is True

    def get(self, key: str) -> bytes:
        """``key``'s value (the server waits up to GET_WAIT_S for it to be set)."""
        return str(self._request("get", key)).encode()

    def value(self, key: str, default: str) -> str:
        """``key``'s value, or ``default`` for a key not set (at once)."""
        return str(self._request("value", key, default))

    def vote(
        self,
        attempt: str,
        members: int,
        done: bool,
        position: str,
        wait_s: float,
        leaving: bool = False,
        voter: str = "",
    ) -> tuple[bool, str, bool]:
        """This member's vote on ``attempt`` and the run's verdict (Verdicts._vote): (commit,
        the run's place in the data, whether the next step agrees on its members again). The
        request is bounded by ``wait_s`` + VOTE_MARGIN_S. ``voter``: this member's name (its
        vote sent again is counted once)."""
        self._socket.settimeout(wait_s + VOTE_MARGIN_S)
        try:
            verdict, position_of_run, again = self._request("vote", attempt, members, done,
                                                            position, wait_s, leaving,
                                                            voter)  # fmt: skip
        finally:
            self._socket.settimeout(self.timeout_s)
        return verdict == "commit", str(position_of_run), again is True

    def pulse(self, member: str, seen: int) -> tuple[int, list[str]]:
        """``member`` is alive (Pulses.pulse): the count of members gone, and those gone after
        the first ``seen``."""
        count, gone = self._request("pulse", member, seen)
        return int(count), [str(m) for m in gone]

    def leave(self, member: str) -> None:
        """``member`` leaves: the end of its pulse's connection is no death."""
        self._request("leave", member)

    def abort_missing(self, attempt: str, member: str, ranks: int = 1) -> bool:
        """``member`` of ``attempt`` is gone: abort it unless decided or ``member`` voted done
        on it with each of its ``ranks``; whether its verdict is abort."""
        return self._request("abort_missing", attempt, member, ranks) is True

    def restore(self, known: dict[str, str]) -> list[str]:
        """Tell the store what this member knows of the run (Verdicts._restore); the keys
        whose value there differs."""
        return [str(key) for key in self._request("restore", known)]

    def close(self) -> None:
        """Close the connection; a request waiting in another thread ends (an OSError)."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._broken = self._broken or ConnectionError("the store was closed")
            self._reader.close()
            self._socket.close()


class VerdictServer:
    """The store's server on ``host``:``port`` (0: a free one), in daemon threads of this
    process, until ``close``; a member whose pulse's connection closes, or that is silent on
    it for ``heartbeat_timeout_s``, is gone (pulses.py)."""

    def __init__(
        self, host: str, port: int, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    ) -> None:
        self.verdicts = verdicts = Verdicts(heartbeat_timeout_s)
        self._connections: set[socket.socket] = set()
        connections = self._connections
        self._closed = threading.Event()

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with verdicts.changed:
                    connections.add(self.connection)
                pulsing = ""  # the member whose pulse this connection carries
                try:
                    for line in self.rfile:
                        try:
                            op, *args = json.loads(line)
                            pulsing = str(args[0]) if op == "pulse" else pulsing
                            value = verdicts.answer(str(op), args, self.reply)
                            if value is ANSWERED:
                                continue
                            answer = {"value": value}
                        except (ValueError, TypeError, KeyError, IndexError) as error:
                            answer = {"error": f"{type(error).__name__}: {error}"}
                        self.wfile.write(json.dumps(answer).encode() + b"\n")
                except OSError:  # a member killed mid-request resets its connection: no error
                    return
                finally:
                    with verdicts.changed:
                        connections.discard(self.connection)
                        if pulsing:
                            verdicts.pulses.closed(pulsing)

            def reply(self, value: Any) -> None:
                """This member's answer, written by the request that decided it."""
                with contextlib.suppress(OSError):  # a member gone: nothing to answer
                    self.wfile.write(json.dumps({"value": value}).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(
            target=self._server.serve_forever, name="nn_handler-verdicts", daemon=True
        ).start()
        threading.Thread(target=self._sweep, name="nn_handler-pulses", daemon=True).start()

    def _sweep(self) -> None:
        """Every eighth of the heartbeat timeout: the members silent that long are gone."""
        verdicts = self.verdicts
        while not self._closed.wait(verdicts.pulses.timeout_s / 8):
            with verdicts.changed:
                verdicts.pulses.sweep(time.monotonic())

    def close(self) -> None:
        """Stop serving and close every member's connection (as the process's end would)."""
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        with self.verdicts.changed:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


__all__ = [
    "ANSWERED",
    "COMMITTED",
    "GET_WAIT_S",
    "FINISHED",
    "HEARTBEAT_TIMEOUT_S",
    "JOINS",
    "LIFE",
    "VOTE_MARGIN_S",
    "VerdictServer",
    "VerdictStore",
    "Verdicts",
]
