"""Run in a network namespace of its own (tests/netns.py's ``cut_off``), not by pytest: brings
the namespace's loopback up, bridges the given ports of 127.0.0.1 to ``FOLDER/<port>.sock``
(where tests/netns.py's UnixBridge forwards them to the machine's 127.0.0.1), and runs a
Python script in this process.

Usage: python cut_off.py FOLDER PORT[,PORT...] SCRIPT [ARGS...]
       python cut_off.py --check   (exit 0 when the loopback comes up and takes a connection)
"""

from __future__ import annotations

import fcntl
import runpy
import socket
import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

from tests.netns import forward

#: Linux's ioctls that read and set an interface's flags, and its "up" flag.
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` up: a new network namespace's loopback is down (no 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        asked = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, asked))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def bridge(folder: Path, port: int) -> None:
    """127.0.0.1:``port`` here forwards to ``folder/<port>.sock`` (outside)."""
    server = socket.create_server(("127.0.0.1", port))

    def accept() -> None:
        while True:
            client, _ = server.accept()
            outside = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                outside.connect(str(folder / f"{port}.sock"))
            except OSError:
                client.close()
                continue
            forward(client, outside)

    threading.Thread(target=accept, daemon=True).start()


def main() -> None:
    loopback_up()
    if sys.argv[1] == "--check":
        with socket.create_server(("127.0.0.1", 0)) as server:
            socket.create_connection(server.getsockname()[:2], timeout=5).close()
        return
    folder, ports, script, *args = sys.argv[1:]
    for port in ports.split(","):
        bridge(Path(folder), int(port))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
