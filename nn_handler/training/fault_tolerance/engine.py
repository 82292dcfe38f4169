"""The fault-tolerance mode's engine: every use of torchft, and of every name neither torchft
nor torch makes public, is in this module (docs/architecture.md lists them). The rest of
``fault_tolerance/`` speaks to what it gives: a member's Manager and group, the quorum's id,
the Lighthouse's server, the transport's base class. Checked with torchft 0.2.0 and torch
2.13; torchft 0.3 removes ``ProcessGroup.configure()``, so ``require_torchft`` refuses it.

What it relies on, beyond torchft's public ``Manager`` and ``ProcessGroupGloo``:

- ``Manager._quorum_id`` (private): the Lighthouse's id of the quorum, read after each
  ``start_quorum``, and set to -1 after an abandoned step so the next builds a new group.
- ``Manager._quorum_future`` (private): set to None after a quorum failed, so that the next
  ``start_quorum`` asks again instead of raising that failure again.
- ``Manager._client._quorum`` and the Manager's ``_group_rank``, ``_step``,
  ``_checkpoint_transport``, ``_init_sync``, ``_commit_failures`` (private): a request for a
  quorum sent again while one is in flight whose Lighthouse died (``ask_quorum_again``).
- ``ProcessGroup.configure(store_addr, replica_id, rank, world_size, quorum_id, ...)``
  (called by the Manager with these positional arguments; gone in 0.3): wrapped so that each
  attempt of a step gets a store prefix of its own.
- ``torchft.manager.ManagerServer`` (a module attribute, replaced while a Manager is made):
  torchft binds its server on every interface with no setting for it.
- ``torchft._torchft.LighthouseServer`` (a private module): the Lighthouse.
- ``torchft.checkpointing.transport.CheckpointTransport``: the base of VerifiedTransport.
- ``torch._C._distributed_c10d``'s ``AllgatherOptions`` (the options of a group's allgather)
  and ``TCPStore`` (the member group's own store, which the Manager needs): torch re-exports
  ``TCPStore`` from ``torch.distributed`` but not explicitly (a type checker refuses that
  name), and ``AllgatherOptions`` not at all.
- the ``torchft.manager`` logger's messages (``FlightRecorder`` lines; gloo's error text).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib import metadata
from typing import Any

from torch._C._distributed_c10d import AllgatherOptions, TCPStore

from nn_handler.errors import ConfigError


def __getattr__(name: str) -> Any:
    """``CheckpointTransport``, torchft's, imported when first asked for (by transport.py,
    which a member imports): importing nn_handler imports no torchft."""
    if name != "CheckpointTransport":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from torchft.checkpointing.transport import CheckpointTransport
    except ImportError:  # no ft extra: require_torchft says how to install it first
        return object
    return CheckpointTransport


#: The torchft releases the mode works with: 0.3 removes ``ProcessGroup.configure()``.
TORCHFT_SUPPORTED = ">=0.2,<0.3"


def require_torchft() -> None:
    """Raise a ConfigError saying how to install torchft where it is missing, or where its
    version is one the mode does not support."""
    try:
        import torchft  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"the fault-tolerance mode needs torchft ({error}): pip install 'nn_handler[ft]'."
        ) from None
    version = metadata.version("torchft")
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    if (major, minor) < (0, 2) or (major, minor) >= (0, 3):
        raise ConfigError(
            f"the fault-tolerance mode needs torchft{TORCHFT_SUPPORTED}, but {version} is "
            f"installed: pip install 'torchft{TORCHFT_SUPPORTED}' (on every member and the "
            "Lighthouse's machine)."
        )


def load_lighthouse() -> None:
    """Import torchft's Lighthouse (a spare's, before it waits to listen)."""
    require_torchft()
    from torchft._torchft import LighthouseServer  # noqa: F401


def lighthouse_server(
    bind: str, min_members: int, join_timeout_s: float, heartbeat_timeout_s: float
) -> Any:
    """torchft's Lighthouse serving on ``bind`` (host:port) until it is dropped."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_members,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )


def member_group(timeout: timedelta, attempt_of: Callable[[int], str]) -> Any:
    """torchft's reconfigurable gloo group of a member, whose every configuration (a quorum's,
    an attempt's) gets a store prefix of its own: ``attempt_of(quorum_id)`` names the step's
    attempt in that quorum. An abandoned attempt's group is never reused (torchft configures
    a group only when the quorum's id changes, and a step abandoned by members all alive
    keeps it), and the new one never meets the keys of the one before."""
    require_torchft()
    from torchft import ProcessGroupGloo

    group: Any = ProcessGroupGloo(timeout=timeout)
    configure = group.configure

    def configure_attempt(store_addr: str, *args: Any) -> None:
        quorum = args[3]  # (replica_id, rank, world_size, quorum_id, ...): torchft 0.2's order
        configure(f"{store_addr}/attempt{attempt_of(quorum)}", *args)

    group.configure = configure_attempt
    return group


def abort_later(group: Any, work: Any, timeout: timedelta) -> None:
    """Abort ``group`` once ``work``, a collective of it still in flight, ends (at gloo's
    ``timeout``; a member stopped never answers it): torchft's abort would wait for it now,
    holding the GIL. The group is dropped at once: its next configuration makes a new one."""
    pg, group._pg = group._pg, None

    def later() -> None:
        with contextlib.suppress(Exception):  # its failure is the point
            work.wait(timeout)
        if pg is not None and hasattr(pg, "abort"):
            pg.abort()

    threading.Thread(target=later, name="nn_handler-abort", daemon=True).start()


def member_manager(host: str, **settings: Any) -> Any:
    """torchft's Manager of a member (``settings``: its arguments), its server listening on
    ``host`` only; torchft's log lines about it made one line each."""
    require_torchft()
    from torchft import Manager

    _quiet_torchft()
    with _listening_on(host):
        manager = Manager(hostname=host, store_addr=host, **settings)
    manager._client = _MembersOfQuorums(manager._client)
    return manager


class _MembersOfQuorums:
    """A manager's client that keeps the replica ids of the last quorum it was given."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.members: list[str] = []

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.members = [str(member) for member in quorum.replica_ids]
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def quorum_members(manager: Any) -> list[str]:
    """The replica ids of the members of the manager's last quorum (``replica_id``'s)."""
    return list(manager._client.members)


def replica_id(manager: Any) -> str:
    """The manager's replica id, as the Lighthouse's quorums name it (its ``replica_id``
    and a uuid: torchft 0.2's)."""
    from torchft.manager import REPLICA_ID_KEY

    return str(manager._store.get(REPLICA_ID_KEY).decode())


def quorum_id(manager: Any) -> int:
    """The Lighthouse's id of the manager's current quorum."""
    return int(manager._quorum_id)


def forget_quorum(manager: Any) -> None:
    """Make the manager's next quorum configure a new group, even with the same members."""
    manager._quorum_id = -1


def ask_quorum_again(manager: Any, timeout: timedelta) -> None:
    """Send the manager's request for a quorum again, beside the one in flight (its
    Lighthouse died under it: torchft's server then waits out the request's timeout without
    asking the new one): the server asks the Lighthouse again and answers both requests with
    its quorum. Blocks until then; an error if the server could not ask (the same arguments as
    torchft 0.2's ``Manager._async_quorum``)."""
    manager._client._quorum(
        group_rank=manager._group_rank,
        step=manager._step,
        checkpoint_metadata=manager._checkpoint_transport.metadata(),
        shrink_only=False,
        timeout=timeout,
        init_sync=manager._init_sync,
        commit_failures=manager._commit_failures,
    )


def drop_failed_quorum(manager: Any) -> None:
    """Let the manager ask for a quorum again after one failed (torchft's ``start_quorum``
    raises the last one's error again otherwise)."""
    manager._quorum_future = None


def cause(error: BaseException) -> str:
    """An error's first line, without gloo's source location and advice (its name if empty)."""
    first = (str(error).strip().splitlines() or [""])[0]
    cause = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]
    return cause or type(error).__name__


class _NoFlightRecorder(logging.Filter):
    """Drops torchft's warning, at every change of members, that it cannot reset NCCL's flight
    recorder: said on every build without NCCL (gloo, CPU), where there is nothing to reset;
    and says its failures (a state transfer cut by a death) in one line, without a traceback:
    the step's abandonment says the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "flight recorder" in message:
            return False
        if record.exc_info:
            first = message.splitlines()[0] if message else ""
            first = re.sub(r"\[/[^\]]*\]\s*", "", first)  # gloo's source location
            record.msg, record.args = first.split(". This is typically")[0], ()
            record.exc_info = record.exc_text = None
        return True


def _quiet_torchft() -> None:
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorder) for f in logger.filters):
        logger.addFilter(_NoFlightRecorder())


@contextlib.contextmanager
def _listening_on(host: str) -> Iterator[None]:
    """torchft's Manager starts its server on every interface (``[::]``), with no setting for
    it; this makes it listen on ``host`` only, while the Manager is made."""
    import torchft.manager as module

    original = module.ManagerServer

    def on_host(**kwargs: Any) -> Any:
        port = str(kwargs.get("bind", ":0")).rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"{host}:{port}"})

    module.ManagerServer = on_host
    try:
        yield
    finally:
        module.ManagerServer = original


__all__ = [
    "TORCHFT_SUPPORTED",
    "AllgatherOptions",
    "TCPStore",
    "abort_later",
    "ask_quorum_again",
    "cause",
    "drop_failed_quorum",
    "forget_quorum",
    "lighthouse_server",
    "load_lighthouse",
    "member_group",
    "member_manager",
    "quorum_id",
    "quorum_members",
    "replica_id",
    "require_torchft",
]
