"""A TCP proxy on 127.0.0.1 that can fall silent: the network fault of an object store whose
endpoint accepts connections and never answers (a dropped route, a wedged proxy).

``SilentProxy(target_port)`` forwards to ``127.0.0.1:target_port``; ``silent = True`` keeps
every connection open (new ones are accepted too) and forwards nothing either way, so a client
without a read timeout waits forever. ``SilentProxy(None)`` is a black hole from the start.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class SilentProxy:
    def __init__(self, target_port: int | None) -> None:
        self.target_port = target_port
        self.silent = target_port is None
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = int(self._server.getsockname()[1])
        self._open: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._open.append(client)
            if self.target_port is None:
                continue  # held open, never read
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._open.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.silent:
                    sink.sendall(data)
            if not self.silent:
                sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        for sock in [self._server, *self._open]:
            with contextlib.suppress(OSError):
                sock.close()


__all__ = ["SilentProxy"]
