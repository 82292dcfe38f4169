"""One live job per checkpoint folder: ``.nn_handler.lock``, taken by rank 0 with one
create-if-absent (``O_EXCL``, or an object store's conditional write) and released at close.
A stale lock (its process gone from this host, an earlier start of this job, or an object
store's lease run out) is taken over with a warning; a live holder fails the start, named.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.store.remote_store import RemoteStore
from nn_handler.distributed.faults.liveness import process_running
from nn_handler.errors import CheckpointError

LOCK = ".nn_handler.lock"
#: Seconds without a renewal after which an object store's holder is taken for dead.
DEFAULT_LEASE_S = 120.0
#: The launchers' ids of a job, which its restarts keep.
_JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def job_of(env: Mapping[str, str]) -> str | None:
    """The launcher's id of this job (which its restarts keep), as ``NAME=value``."""
    for name in _JOB_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != "none":
            return f"{name}={value}"
    return None


class FileLock:
    """The lock of a local folder. A lock place: ``create`` writes only where there is none
    (whether it did; NotImplementedError: it cannot), ``age`` by the place's own clock,
    ``once`` the same place without retries."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self.where = str(self.path)

    def create(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return True

    def read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def write(self, data: bytes) -> None:
        self.path.write_bytes(data)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def age(self) -> float | None:
        try:
            return max(0.0, time.time() - self.path.stat().st_mtime)
        except OSError:
            return None

    def once(self) -> FileLock:
        return self


class ObjectLock:
    """The lock of an object store's folder."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.where = store.url_of(LOCK)

    def create(self, data: bytes) -> bool:
        return self.store.create(LOCK, data)

    def read(self) -> bytes | None:
        return self.store.read(LOCK)

    def write(self, data: bytes) -> None:
        self.store.write(LOCK, data)

    def remove(self) -> None:
        self.store.remove(LOCK)

    def age(self) -> float | None:
        return self.store.age(LOCK)

    def once(self) -> ObjectLock:
        return ObjectLock(self.store.once())


#: Where a folder's lock lives.
LockPlace = FileLock | ObjectLock


class Lease:
    """This process's hold on the folder ``folder`` (rank 0) through its lock ``place``;
    ``lease_s``: renewed, and taken for dead without a renewal that long (None: held until
    released; a local folder's holder is known alive or gone on its own host)."""

    def __init__(self, place: LockPlace, folder: str, lease_s: float | None = None) -> None:
        self.place, self.folder, self.lease_s = place, folder, lease_s
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me: dict[str, Any] = {}
        #: Why this process no longer holds the folder (None: it does, or never did): another
        #: job took the lock over; this one must not write there again.
        self.lost: str | None = None

    def acquire(self, env: Mapping[str, str]) -> None:
        """Take the lock (taking over a stale one with a warning), or raise CheckpointError
        naming the live holder."""
        self._me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_of(env),
                    "lease": secrets.token_hex(8)}  # fmt: skip
        for _ in range(3):  # another starter may take or drop it between our looks
            try:
                created = self.place.create(self._body())
            except NotImplementedError:
                logger.bind(rank=0).warning(
                    "{}: this store cannot write an object only where none exists, so the "
                    "folder has no lock: make sure one job at a time uses it",
                    self.folder,
                )
                return
            if created:
                self.held = True
                if self.lease_s is not None:
                    self._thread = threading.Thread(
                        target=self._renew, name="nn_handler-lease", daemon=True
                    )
                    self._thread.start()
                return
            holder = self._read(self.place)
            why = self._why_stale(holder)
            if not why:
                raise CheckpointError(self._in_use(holder or {}))
            if holder and (holder.get("host"), holder.get("pid")) != self._mine():
                logger.bind(rank=0).warning(
                    "{}: taking over the lock of {} (pid {} on {}): {}",
                    self.folder, holder.get("job") or "a job", holder.get("pid"),
                    holder.get("host"), why,
                )  # fmt: skip
            self.place.remove()
        raise CheckpointError(
            f"could not take the lock {self.place.where}: it keeps changing hands."
        )

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still this lease's (best effort: not
        one this process took again since, say a second store of the same folder)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not self.held:
            return
        self.held = False
        place = self.place.once()  # a lease runs out by itself: one try each, no retries
        try:
            holder = self._read(place)
            if holder and holder.get("lease") == self._me["lease"]:
                place.remove()
        except CheckpointError as error:
            logger.warning("could not release the lock of {}: {}", self.folder, error)

    # ----------------------------------------------------------------- the lock's contents
    def _mine(self) -> tuple[Any, Any]:
        return self._me["host"], self._me["pid"]

    def _body(self) -> bytes:
        lease = {} if self.lease_s is None else {"lease_s": self.lease_s}
        return json.dumps({**self._me, "time": time.time(), **lease}).encode()

    @staticmethod
    def _read(place: LockPlace) -> dict[str, Any] | None:
        """The holder (None: no lock; {}: an unreadable one)."""
        try:
            data = place.read()
        except OSError:
            return {}
        if data is None:
            return None
        try:
            found = json.loads(data)
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    def _why_stale(self, holder: dict[str, Any] | None) -> str:
        """Why ``holder`` no longer holds the folder ('' when it does). Its lease is measured
        by the store's clock (the lock's age there), never by comparing this machine's clock
        with the holder's: a machine whose clock ran 300 s ahead took a live job's lease."""
        if holder is None:
            return "it is gone"
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return "the lock is unreadable"
        if holder.get("host") == self._me["host"]:
            if pid == self._me["pid"]:
                return "it is this process"
            # A live process on this host is a live job, whatever ids it shares with this
            # one (two srun steps of one allocation, a reused --rdzv-id): never a restart.
            return "" if process_running(pid) else "its process is gone"
        if holder.get("job") and holder.get("job") == self._me["job"]:
            return "it is an earlier start of this same job (a restart)"
        lease = holder.get("lease_s", self.lease_s)
        if self.lease_s is not None and isinstance(lease, (int, float)) and lease > 0:
            silent = self.place.age()
            if silent is not None and silent > lease:
                return f"its lease ran out ({silent:.0f} s without a renewal, by the store's clock)"
        return ""

    def _in_use(self, holder: Mapping[str, Any]) -> str:
        taken = float(holder.get("time", 0))
        if self.lease_s is None:
            since, expiry = f"since {time.ctime(taken)}", ""
        else:
            since = f"its lease renewed {time.time() - taken:.0f} s ago"
            expiry = f"its lease runs out {self.lease_s:g} s after its last renewal; "
        return (
            f"checkpoint folder {self.folder} is in use by another live job: "
            f"{holder.get('job') or 'a job'} (pid {holder.get('pid')} on {holder.get('host')}, "
            f"{since}). Two runs in one folder would rotate and resume each other's "
            f"checkpoints: use another checkpoint.dir, or stop that job ({expiry}delete "
            f"{self.place.where} if it is gone)."
        )

    def check_held(self) -> None:
        """Raise CheckpointError when another job took the folder's lock over: this one must
        not write there again (its checkpoints would mix with the other job's)."""
        if self.lost is not None:
            raise CheckpointError(
                f"checkpoint folder {self.folder} is no longer this job's: {self.lost}. "
                f"Nothing more is written there; give each job its own checkpoint.dir."
            )

    def _renew(self) -> None:
        while self.lease_s is not None and not self._stop.wait(self.lease_s / 4):
            try:
                holder = self._read(self.place)
                if holder is not None and (holder.get("host"), holder.get("pid")) != self._mine():
                    self.lost = (
                        f"{holder.get('job') or 'a job'} (pid {holder.get('pid')} on "
                        f"{holder.get('host')}) took its lock over"
                    )
                    self.held = False
                    logger.bind(rank=0).error("{}: {}", self.folder, self.lost)
                    return
                self.place.write(self._body())
            except CheckpointError as error:  # said; the next renewal tries again
                logger.warning("could not renew the lock of {}: {}", self.folder, error)


__all__ = ["DEFAULT_LEASE_S", "LOCK", "FileLock", "Lease", "ObjectLock", "job_of"]
