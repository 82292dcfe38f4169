"""The Lighthouse: the coordinator of the fault-tolerance mode, which decides each step's
members from their heartbeats. It runs in a process of its own (a launcher, a supervisor, a
job step), never in a member that can die: with it gone the members cannot agree on a step,
and the run falls back to a restart from its latest checkpoint."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from nn_handler.errors import ConfigError


def require_torchft() -> None:
    """Raise a ConfigError saying how to install torchft where it is missing."""
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"the fault-tolerance mode needs torchft ({error}): pip install 'nn_handler[ft]'."
        ) from None


class Lighthouse:
    """A torchft Lighthouse listening on ``host`` (``port`` 0: a free one).

    Args:
        min_members: the fewest members a step may have.
        join_timeout_s: how long a new quorum waits for members still starting.
        heartbeat_timeout_s: a member silent that long is left out of the next step.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        min_members: int = 1,
        join_timeout_s: float = 0.2,
        heartbeat_timeout_s: float = 1.0,
    ) -> None:
        require_torchft()
        from torchft._torchft import LighthouseServer

        self.host = host
        self._server: Any = LighthouseServer(
            bind=f"{host}:{port}",
            min_replicas=min_members,
            join_timeout_ms=int(join_timeout_s * 1000),
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        # The server names itself by the machine's hostname; members dial the host it bound.
        self.port = int(str(self._server.address()).rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        """What members are given to find it (``http://host:port``)."""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop it (members then fail their next quorum)."""
        self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["Lighthouse", "require_torchft"]
