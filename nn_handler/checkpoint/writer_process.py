"""WriterProcess: a rank's asynchronous sharded saves serialized, written and checksummed in a
process of their own, outside the training process's GIL (``checkpoint.async_writer:
process``).

DCP's save runs as before in the background thread: its planning, its collectives on the
checkpoint group and its index stay in this process. Only the one call that does the heavy
work, ``ChecksummingWriter.write_data``, is handed over: its items (the CachedStager's buffers,
allocated in shared memory, so only their handles cross the pipe) go to the child, which
writes them through DCP's FileSystemWriter with the verifier's checksumming streams and sends
back the checked results. A child that dies or fails makes that save a CheckpointError on
every rank (through the save's own agreement); the next save starts a new child.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nn_handler.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported with the first save, not before
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult

#: Seconds between two looks at whether a busy child is still alive.
_POLL_S = 0.5


class WriterProcess:
    """One child process writing this rank's shards (started at the first write)."""

    def __init__(self, serve: Callable[[Any], None]) -> None:
        """``serve(connection)``: the child's loop (ChecksummingWriter's ``serve_writes``):
        it receives (path, plan, items) and sends back ("ok", results) or ("error", text),
        until it receives None. A ConfigError when this process may not start children."""
        if mp.current_process().daemon:
            raise ConfigError(
                f"checkpoint.async_writer='process': this rank runs in a daemonic process "
                f"({mp.current_process().name}), which may not start a writer process; use "
                f"async_writer='thread', or launch the ranks with torchrun or nn_handler.launch."
            )
        self._serve = serve
        self._process: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    def write(
        self, path: str, plan: SavePlan, items: list[tuple[WriteItem, Any]]
    ) -> list[WriteResult]:
        """Write ``items`` (each write item with its resolved data) of ``plan`` into the
        folder ``path`` in the child; their checked WriteResults. CheckpointError when the
        child fails or dies."""
        payload = [(item, _sendable(data)) for item, data in items]
        with self._lock:
            self._start()
            process, conn = self._process, self._conn
            try:
                conn.send((path, plan, payload))
                while not conn.poll(_POLL_S):
                    if not process.is_alive() and not conn.poll(0):  # its answer may be in
                        raise EOFError
                kind, value = conn.recv()
            except (EOFError, OSError) as error:
                self._stop()
                raise CheckpointError(
                    f"the checkpoint writer process (pid {process.pid}) died (exit code "
                    f"{process.exitcode}) while writing {path}; the next save starts another"
                ) from error
        if kind != "ok":
            raise CheckpointError(f"the checkpoint writer process failed writing {path}: {value}")
        return list(value)

    def close(self) -> None:
        """Stop the child (it finishes nothing: call after the last save was waited for)."""
        with self._lock:
            self._stop()

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self._stop()
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=self._serve, args=(child,), name="nn_handler-writer", daemon=True
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent

    def _stop(self) -> None:
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            conn.send(None)
        process.join(timeout=10.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=10.0)
        conn.close()


def _sendable(data: Any) -> Any:
    """A BytesIO's bytes (a pipe cannot carry the stream itself); tensors as they are (their
    shared-memory storage crosses as a handle)."""
    return data.getvalue() if isinstance(data, io.BytesIO) else data


__all__ = ["WriterProcess"]
