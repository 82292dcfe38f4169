"""Sharded checkpoints: a folder every rank writes through torch.distributed.checkpoint (DCP)
and any number of ranks loads (layout: docs/checkpoints.md, "Sharded checkpoints").

The writer writes into the store's staging folder and knows nothing of stores; loading reads
nothing that can run code (checkpoint/safe_dcp.py), after ``verify_sharded`` checked the files.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.async_staging import CachedStager
from nn_handler.checkpoint.format import CHECKSUMS, REST
from nn_handler.checkpoint.io import write_file
from nn_handler.checkpoint.manifest import MANIFEST
from nn_handler.checkpoint.sharded_errors import (
    causes_of,
    dcp_errors,
    failure_text,
    save_failure,
)
from nn_handler.checkpoint.verify import verify_files
from nn_handler.checkpoint.writing import WriteJob, Written
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError


class ShardedWriter:
    """Writes ``contents`` = ``(rest, shards)``: rank 0 ``rest`` as the REST file, every rank
    its ``shards`` through DCP on ``group()`` (None in one process), checksummed as they pass.
    A background save first copies this rank's shards into CPU buffers kept between saves."""

    folder = True

    def __init__(self, comm: Communicator, group: Callable[[], dist.ProcessGroup | None]) -> None:
        self.comm = comm
        self._group = group
        self._stager = CachedStager()

    def begin(self, job: WriteJob) -> Callable[[], Written]:
        """Rank 0's REST file and (``background``) this rank's copy now; the DCP write after.
        A refusal is raised in DCP's planning, so every rank learns it before any writes."""
        (rest, shards), staging, where, refusal = job.contents, job.staging, job.where, job.refusal
        if self.comm.rank == 0 and refusal is None:
            refusal = _prepare(staging, rest, where)
        writer = _writer(staging)
        staged = shards
        if job.background:
            try:
                staged = self._stager.stage(shards)
            except Exception as caught:  # (memory full, say)
                failure = f"copying this rank's state: {type(caught).__name__}: {caught}"
                refusal = refusal or failure
        writer.refusal = refusal
        group = self._group()
        options: dict[str, Any] = {"process_group": group, "no_dist": group is None}

        def write() -> Written:
            try:
                dcp_save(staged, writer, options)
            except dcp_errors() as caught:
                return Written(error=save_failure(caught, where, staging, shards))
            names = list(getattr(writer, "written", []))
            names += [REST] if self.comm.rank == 0 else []
            files = [staging / name for name in names]
            known, every = getattr(writer, "entries", {}), getattr(writer, "files", {})
            return Written(files, dict(known), dict(every))

        return write


def verify_sharded(folder: str | Path, comm: Communicator | None, rest: Any) -> None:
    """Check the folder's files against its manifest, each rank a share (``comm`` None: all,
    here); ``rest``: its REST contents. Every rank must call this; all raise the same
    CheckpointError when any rank found a bad file."""
    path = Path(folder)
    required = isinstance(rest, Mapping) and rest.get(CHECKSUMS) == MANIFEST
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    error: CheckpointError | None = None
    try:
        verify_files(path, rank, world, required)
    except CheckpointError as caught:
        error = caught
    if comm is None:
        if error is not None:
            raise error
        return
    with comm.patient():  # a rank with a large share reads for a while
        agree_on(comm, error, f"verifying checkpoint {path}")


def load_shards(
    path: str | Path, template: dict[str, Any], group: dist.ProcessGroup | None
) -> None:
    """Fill ``template`` (the parts' ``shards()``) in place from the verified folder ``path``,
    resharded to this run's ranks. Every rank must call this; a failure on any rank is a
    CheckpointError on every rank."""
    from torch.distributed.checkpoint.state_dict_loader import load

    from nn_handler.checkpoint.safe_dcp import SafeLoadPlanner, SafeReader

    try:
        if group is None:
            quiet_one_process_notice()
        load(
            template,
            storage_reader=SafeReader(str(path)),
            planner=SafeLoadPlanner(path),
            process_group=group,
            no_dist=group is None,
        )
    except CheckpointError:
        raise
    except dcp_errors() as error:  # DCP raised the same error on every rank
        ours = [c for c in causes_of(error) if isinstance(c, CheckpointError)]
        if ours:  # a refused index or value: the file is at fault, not the model
            raise CheckpointError(f"cannot load the shards of {path}: {ours[0]}") from error
        raise CheckpointError(
            f"cannot load the shards of {path}: {failure_text(error)}. Build the model, "
            f"optimizers and EMA the same way as the run that wrote it."
        ) from error


#: DCP's notice, at every save and load without a process group, that it runs in one process.
ONE_PROCESS_NOTICE = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"(save|load) in a single process"
)


def quiet_one_process_notice() -> None:
    """Ignore DCP's one-process notice for the rest of the process: one filter, added once
    (``catch_warnings`` is not thread-safe, and resets every "once" registry on leaving)."""
    for action, message, *_ in warnings.filters:
        if action == "ignore" and message is not None and message.pattern == ONE_PROCESS_NOTICE:
            return
    warnings.filterwarnings(
        "ignore", message=ONE_PROCESS_NOTICE, module=r"torch\.distributed\.checkpoint"
    )


def dcp_save(shards: dict[str, Any], writer: Any, options: dict[str, Any]) -> None:
    """DCP's save of ``shards`` through ``writer`` (its collectives on ``options``' group)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    if options["no_dist"]:
        quiet_one_process_notice()
    save(shards, storage_writer=writer, **options)


def _writer(staging: Path) -> Any:
    from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter

    return ChecksummingWriter(str(staging), sync_files=True)


def _prepare(staging: Path, rest: Mapping[str, Any] | None, where: str) -> str | None:
    """Rank 0: an empty staging folder holding the REST file."""
    if rest is None:
        return "no checkpoint contents were given on rank 0"
    try:
        if staging.exists():  # left by a save that was killed
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)  # (another rank's DCP may have made it)
        write_file({**rest, CHECKSUMS: MANIFEST}, staging / REST, name=f"{where}/{REST}")
    except Exception as caught:
        return f"{type(caught).__name__}: {caught}"
    return None


__all__ = ["CachedStager", "ShardedWriter", "load_shards", "verify_sharded"]
