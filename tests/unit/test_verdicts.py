"""The verdicts' store (training/fault_tolerance/verdicts.py), the members' one agreement
channel: its semantics (the first write of a key stands; counts; waits), its refusals, and a
Lighthouse that dies: one OSError in the member, nothing on stderr (issue 69, item 8: torch's
TCPStore client printed a C++ warning with its stack frames for every request after it)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore


@pytest.fixture
def served() -> tuple[VerdictServer, VerdictStore]:
    server = VerdictServer("127.0.0.1", 0)
    store = VerdictStore("127.0.0.1", server.port, 5.0)
    yield server, store
    store.close()
    server.close()


def test_the_first_value_written_stands_and_counts_add_up(
    served: tuple[VerdictServer, VerdictStore],
) -> None:
    server, store = served
    assert store.compare_set("v", "", "commit") == b"commit"
    assert store.compare_set("v", "", "abort") == b"commit"  # the first verdict stands
    assert store.compare_set("v", "commit", "again") == b"again"  # set when it holds expected
    assert store.compare_set("unset", "x", "y") == b"x"  # not set, another expected: no write
    assert not store.check(["unset"]) and store.check(["v"]) and store.check([])
    other = VerdictStore("127.0.0.1", server.port, 5.0)  # a second member sees the same
    try:
        assert [store.add("done", 1), other.add("done", 1), other.add("done", 3)] == [1, 2, 5]
        assert other.get("v") == b"again"
    finally:
        other.close()


def test_a_get_waits_for_its_key(served: tuple[VerdictServer, VerdictStore]) -> None:
    server, store = served
    late = VerdictStore("127.0.0.1", server.port, 5.0)
    threading.Timer(0.3, lambda: late.compare_set("k", "", "later")).start()
    started = time.monotonic()
    assert store.get("k") == b"later" and time.monotonic() - started >= 0.2
    late.close()


def test_a_request_it_does_not_know_is_refused_by_name(
    served: tuple[VerdictServer, VerdictStore],
) -> None:
    server, store = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        replies = raw.makefile("rb")
        raw.sendall(b'["drop", "k"]\n')
        unknown = json.loads(replies.readline())
        raw.sendall(b"not json\n")  # bytes that are not a request: an error, never run
        malformed = json.loads(replies.readline())
    assert unknown == {"error": "KeyError: \"no request 'drop'\""}, unknown
    assert malformed["error"].startswith("JSONDecodeError"), malformed
    assert store.check([])  # the store goes on


def test_a_store_gone_is_one_oserror_and_nothing_on_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    server = VerdictServer("127.0.0.1", 0)
    store = VerdictStore("127.0.0.1", server.port, 2.0)
    assert store.compare_set("a", "", "x") == b"x"
    server.close()  # the Lighthouse's process gone: its connections close
    for request in (lambda: store.check(["a"]), lambda: store.add("n", 1)):
        with pytest.raises(OSError, match=r"closed the connection|Connection reset"):
            request()
    store.close()
    assert capfd.readouterr().err == ""


def test_a_member_killed_mid_connection_leaves_no_traceback_on_the_lighthouse(
    served: tuple[VerdictServer, VerdictStore], capfd: pytest.CaptureFixture[str]
) -> None:
    """A killed member's socket is reset (RST), not closed: the server's reading thread ends
    quietly (socketserver printed a ConnectionResetError traceback for each before)."""
    import struct

    server, store = served
    for _ in range(3):
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        raw.sendall(b'["add", "n", 1]\n')
        raw.makefile("rb").readline()  # answered: the server now waits for the next line
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()  # an RST, as the kernel sends for a killed process's socket with data
    time.sleep(0.3)
    assert store.add("n", 0) == 3  # the store goes on
    assert "Traceback" not in capfd.readouterr().err
