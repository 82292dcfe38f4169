"""One live job per object-store folder: ``<url>/.nn_handler.lock``, a lease.

An object store cannot tell whether the process holding a lock on another machine lives, so
the lock is a lease: rank 0 creates the object only if it is absent (a conditional write:
S3's ``If-None-Match: *``, fsspec's ``mode="create"``) and renews it every ``lease_s / 4``
seconds from a thread; a start that finds it refuses, naming the holder, unless the lease
ran out (``lease_s`` without a renewal: the holder was killed), the holder is this host's and
its process is gone, or it is an earlier start of this same job on another host (a torchrun
restart or a SLURM requeue). A store without conditional writes gets no lock, said once at
the start. The local folder lock (checkpoint/folder_lock.py) follows the same rules.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from loguru import logger

from nn_handler.checkpoint.folder_lock import LOCK, job_of, why_stale
from nn_handler.checkpoint.store.remote_store import RemoteStore
from nn_handler.errors import CheckpointError

#: Seconds without a renewal after which a holder is taken for dead.
DEFAULT_LEASE_S = 120.0


class StoreLock:
    """The lease on ``store``'s folder for this process (rank 0)."""

    def __init__(self, store: RemoteStore, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.store = store
        self.lease_s = lease_s
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me: dict[str, Any] = {}

    def acquire(self, env: Mapping[str, str]) -> None:
        """Take the lease (taking over a stale one with a warning), or raise CheckpointError
        naming the live holder. A store without conditional writes: a warning, no lock."""
        self._me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_of(env)}
        where = self.store.url_of(LOCK)
        for _ in range(3):  # another starter may take or drop it between our looks
            created = self._create()
            if created is None:
                logger.bind(rank=0).warning(
                    "{}: this store cannot write an object only where none exists, so the "
                    "folder has no lock: make sure one job at a time uses it",
                    self.store.url,
                )
                return
            if created:
                self.held = True
                self._thread = threading.Thread(
                    target=self._renew, name="nn_handler-store-lock", daemon=True
                )
                self._thread.start()
                return
            found = self._read()  # None: gone since our try; {}: not a lock of ours
            holder = found or {}
            gone = "it is gone" if found is None else "the lock object is unreadable"
            why = self._why_stale(holder) if holder else gone
            if not why:
                since = time.time() - float(holder.get("time", 0))
                raise CheckpointError(
                    f"checkpoint folder {self.store.url} is in use by another live job: "
                    f"{holder.get('job') or 'a job'} (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, its lease renewed {since:.0f} s ago). Two runs in "
                    f"one folder would rotate and resume each other's checkpoints: use another "
                    f"checkpoint.dir, or stop that job (its lease runs out {self.lease_s:g} s "
                    f"after its last renewal; delete {where} if it is gone)."
                )
            if holder:
                logger.bind(rank=0).warning(
                    "{}: taking over the lock of {} (pid {} on {}): {}",
                    self.store.url, holder.get("job") or "a job", holder.get("pid"),
                    holder.get("host"), why,
                )  # fmt: skip
            self.store.remove(LOCK)
        raise CheckpointError(f"could not take the lock {where}: it keeps changing hands.")

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this process's (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not self.held:
            return
        self.held = False
        store = self.store.once()  # the lease runs out by itself: one try each, no retries
        try:
            holder = self._read(store)
            if holder and all(holder.get(k) == self._me[k] for k in ("host", "pid")):
                store.remove(LOCK)
        except CheckpointError as error:
            logger.warning("could not release the lock of {}: {}", self.store.url, error)

    # ----------------------------------------------------------------- the object
    def _body(self) -> bytes:
        return json.dumps({**self._me, "time": time.time(), "lease_s": self.lease_s}).encode()

    def _create(self) -> bool | None:
        """True: created; False: it exists; None: the store cannot create conditionally."""
        try:
            return self.store.create(LOCK, self._body())
        except NotImplementedError:
            return None

    def _read(self, store: RemoteStore | None = None) -> dict[str, Any] | None:
        data = (store or self.store).read(LOCK)
        if data is None:
            return None
        try:
            found = json.loads(data)
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    def _why_stale(self, holder: Mapping[str, Any]) -> str:
        renewed, lease = holder.get("time"), holder.get("lease_s", self.lease_s)
        if isinstance(renewed, (int, float)) and isinstance(lease, (int, float)):
            silent = time.time() - renewed
            if silent > lease:
                return f"its lease ran out ({silent:.0f} s without a renewal)"
        return why_stale(holder, self._me)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.store.write(LOCK, self._body())
            except CheckpointError as error:  # said; the next renewal tries again
                logger.warning("could not renew the lock of {}: {}", self.store.url, error)


__all__ = ["DEFAULT_LEASE_S", "StoreLock"]
