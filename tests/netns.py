"""A real network partition on one machine: a process in a network namespace of its own
(``unshare``), whose only way out is a bridge to some ports of 127.0.0.1 (the Lighthouse's),
over Unix sockets in a folder (a path's socket is reached from every network namespace).

In the namespace, ``tests/scripts/cut_off.py`` brings its loopback up and listens on
127.0.0.1 at each bridged port, forwarding to ``FOLDER/<port>.sock``; out here,
``UnixBridge`` listens on those sockets and forwards to 127.0.0.1:<port>. Everything else the
process tries on 127.0.0.1 (another member's address) reaches its own empty loopback: refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

CUT_OFF = Path(__file__).resolve().parent / "scripts" / "cut_off.py"


def unshare_command() -> list[str]:
    """The command that runs what follows it in a network namespace of its own (a user
    namespace too where this process is not root)."""
    return ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]


def why_no_namespace() -> str:
    """Why this machine cannot make a network namespace ("" when it can)."""
    if shutil.which("unshare") is None:
        return "no `unshare` command"
    probe = subprocess.run(
        [*unshare_command(), sys.executable, str(CUT_OFF), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return "" if probe.returncode == 0 else f"unshare failed: {probe.stderr.strip()[-300:]}"


def cut_off(folder: Path, ports: list[int], command: list[str]) -> list[str]:
    """``command`` (a Python script and its arguments) run cut off, reaching only ``ports``
    of 127.0.0.1 through the bridge of ``folder``."""
    bridged = ",".join(map(str, ports))
    return [*unshare_command(), sys.executable, str(CUT_OFF), str(folder), bridged, *command]


def pump(source: socket.socket, sink: socket.socket) -> None:
    """Forward ``source``'s bytes to ``sink`` until either ends; then end both directions."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)


def forward(client: socket.socket, upstream: socket.socket) -> None:
    """Two pumps: ``client`` and ``upstream`` talk through this process."""
    threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pump, args=(upstream, client), daemon=True).start()


class UnixBridge:
    """Out of the namespace: ``FOLDER/<port>.sock`` forwards to 127.0.0.1:<port>, for each
    of ``ports``, until closed."""

    def __init__(self, folder: Path, ports: list[int]) -> None:
        self._servers: list[socket.socket] = []
        for port in ports:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(folder / f"{port}.sock"))
            server.listen(64)
            self._servers.append(server)
            threading.Thread(target=self._accept, args=(server, port), daemon=True).start()

    @staticmethod
    def _accept(server: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            forward(client, upstream)

    def close(self) -> None:
        for server in self._servers:
            with contextlib.suppress(OSError):
                server.close()

    def __enter__(self) -> UnixBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["UnixBridge", "cut_off", "forward", "pump", "unshare_command", "why_no_namespace"]
