"""Configuration of the fault-tolerance mode (TrainerConfig.fault_tolerance)."""

from __future__ import annotations

import os
import re
import socket

from pydantic import Field, field_validator, model_validator

from nn_handler.config.base import ConfigModel

_ADDRESS = re.compile(r"^http://[^/:\s]+:\d+$")


class FaultToleranceConfig(ConfigModel):
    """Per-step fault tolerance (docs/fault-tolerance.md): each member of the run is a process
    of its own; when one dies or stops answering, the others redo its step without it, in
    their processes, with the same bits (it needs ``reproducible``).

    Attributes:
        lighthouse: the address of the run's Lighthouse, ``http://host:port`` (what
            ``nn-handler lighthouse`` prints), a process where no member runs.
        member_id: this member's name in the run (default: ``<hostname>-<pid>``).
        min_members: the fewest members a step may be committed with; with fewer the run
            waits for members up to ``quorum_timeout_s``, then stops.
        max_members: the most members that train a step's micro-batches (None: every
            member); the others, by rank, are spares: they hold the run's state, take part in
            each step's sum with nothing of their own and train as soon as a member is lost.
        start_members: how many members the run's first step waits for (default
            ``min_members``); a member that starts while the run goes on joins it where it is
            (it receives the state of a live member).
        timeout_s: a member silent this long in a collective is lost (its step is redone).
        quorum_timeout_s: the longest wait for a step's members to be agreed.
        host: the address this member listens on and is reached at.
    """

    lighthouse: str
    member_id: str | None = None
    min_members: int = Field(default=1, ge=1, strict=True)
    max_members: int | None = Field(default=None, ge=1, strict=True)
    start_members: int | None = Field(default=None, ge=1, strict=True)
    timeout_s: float = Field(default=10.0, gt=0)
    quorum_timeout_s: float = Field(default=90.0, gt=0)
    host: str = "127.0.0.1"

    @model_validator(mode="after")
    def _check_sizes(self) -> FaultToleranceConfig:
        if self.max_members is not None and self.max_members < self.min_members:
            raise ValueError(
                f"max_members={self.max_members} is below min_members={self.min_members}: "
                f"no step could be trained; raise max_members or lower min_members"
            )
        if self.start_members is not None and self.start_members < self.min_members:
            raise ValueError(
                f"start_members={self.start_members} is below min_members={self.min_members}: "
                f"the first step waits for {self.start_members} member(s) but needs "
                f"{self.min_members}; raise start_members (or leave it out: min_members) or "
                f"lower min_members"
            )
        return self

    def member_name(self) -> str:
        """This member's name: ``member_id``, or ``<hostname>-<pid>``."""
        return self.member_id or f"{socket.gethostname()}-{os.getpid()}"

    def member_folder(self, folder: str | None) -> str | None:
        """This member's own checkpoint folder in ``folder`` (checkpoint.dir):
        ``<folder>/<member name>``. Each member writes its own periodic checkpoints (a folder
        has one writer) and resumes from them after the loss of the whole run; set
        ``member_id`` so that a restarted member finds its folder again."""
        return None if folder is None else f"{folder.rstrip('/')}/{self.member_name()}"

    @field_validator("lighthouse")
    @classmethod
    def _check_lighthouse(cls, value: str) -> str:
        if not _ADDRESS.match(value):
            raise ValueError(
                f"{value!r} is not a Lighthouse address: give http://host:port, as "
                f"nn-handler lighthouse prints it"
            )
        return value


__all__ = ["FaultToleranceConfig"]
