"""The verdicts' store: the few keys a run's members agree through (each step's votes and
verdict, its place in the data, the run's id and fingerprint), kept by the Lighthouse's
process on its port + 1 and read by every member.

A key-value store over one TCP connection per member, in Python: every request is bounded by
the socket's timeout, including the connection (a stopped host accepts it and never
answers), and a server that is gone is one OSError in the member, not torch's C++ warning
with its stack frames on stderr (TCPStore, which this replaced, printed one per request).
One request a line of JSON, one answer a line of JSON. Loading never runs code."""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from typing import Any

#: How long the server waits for a key a ``get`` asks for before it answers without it.
GET_WAIT_S = 30.0


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

    def close(self) -> None:
        with self._lock:
            self._broken = self._broken or ConnectionError("the store was closed")
            self._reader.close()
            self._socket.close()


class VerdictServer:
    """The store's server on ``host``:``port`` (0: a free one), in daemon threads of this
    process, until ``close``."""

    def __init__(self, host: str, port: int) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()
        self._connections: set[socket.socket] = set()
        store = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with store._changed:
                    store._connections.add(self.connection)
                try:
                    for line in self.rfile:
                        try:
                            op, *args = json.loads(line)
                            answer = {"value": store.answer(str(op), args)}
                        except (ValueError, TypeError, KeyError) as error:
                            answer = {"error": f"{type(error).__name__}: {error}"}
                        self.wfile.write(json.dumps(answer).encode() + b"\n")
                except OSError:  # a member killed mid-request resets its connection: no error
                    return
                finally:
                    with store._changed:
                        store._connections.discard(self.connection)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.port = int(self._server.server_address[1])
        threading.Thread(
            target=self._server.serve_forever, name="nn_handler-verdicts", daemon=True
        ).start()

    def answer(self, op: str, args: list[Any]) -> Any:
        """The answer to one request (the store's whole logic, under one lock)."""
        with self._changed:
            values = self._values
            if op == "add":
                key, amount = str(args[0]), int(args[1])
                values[key] = str(int(values.get(key, "0")) + amount)
                self._changed.notify_all()
                return int(values[key])
            if op == "compare_set":
                key, expected, desired = (str(a) for a in args)
                current = values.get(key)
                if current is None and expected != "":
                    return expected
                if current is None or current == expected:
                    values[key] = desired
                    self._changed.notify_all()
                    return desired
                return current
            if op == "check":
                return all(str(key) in values for key in args[0])
            if op == "get":
                key = str(args[0])
                self._changed.wait_for(lambda: key in values, timeout=GET_WAIT_S)
                return values[key]
            raise KeyError(f"no request {op!r}")

    def close(self) -> None:
        """Stop serving and close every member's connection (as the process's end would)."""
        self._server.shutdown()
        self._server.server_close()
        with self._changed:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


__all__ = ["GET_WAIT_S", "VerdictServer", "VerdictStore"]
