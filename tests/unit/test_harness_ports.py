"""The test harness's ports: each pytest-xdist worker picks from its own share of the ports
below the ephemeral range, and a process never hands out one port twice (between picking
and binding, a port is free to anyone: a rendezvous was lost so)."""

from __future__ import annotations

import pytest

from tests import harness


def test_each_worker_has_its_own_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        shares.append(harness._worker_share(20000, 32768))
    assert shares == [(20000, 26384), (26384, 32768)]
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert harness._worker_share(20000, 32768) == (20000, 32768)  # not under xdist


def test_a_port_is_never_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "_GIVEN", set())
    ports: list[int] = []
    with pytest.raises(RuntimeError, match=r"no free port in \[40000, 40010\)"):
        for _ in range(11):  # at most the 10 ports, then none is left to hand out
            ports.append(harness.free_port(40000, 40010))
    assert ports and len(set(ports)) == len(ports)  # some may be taken by others
    assert all(40000 <= p < 40010 for p in ports)
