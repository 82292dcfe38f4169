"""Configuration of checkpoints, resuming and preemption."""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from nn_handler.config.base import ConfigModel
from nn_handler.config.training import Mode

ResumePolicy = Literal["never", "on_restart", "auto", "force"]
CheckpointFormat = Literal["auto", "file", "sharded"]
AsyncWriter = Literal["thread", "process"]


class CheckpointConfig(ConfigModel):
    """Where and when the Trainer writes checkpoints, and when it resumes from them.

    Nothing is written unless ``dir`` is set. Checkpoints are written by rank 0, atomically
    (a killed save leaves the previous checkpoint intact), and ``dir/latest.json`` names the
    newest complete one.

    Attributes:
        dir: the checkpoint folder (shared by all ranks of a multi-machine run), or the URL
            of a folder on an object store (``s3://bucket/run``, ``gs://``, ``az://``,
            ``file://``, ``memory://``; any fsspec URL): checkpoints are written to a local
            working copy (``staging_dir``), uploaded and committed there (docs/checkpoints.md,
            "Object stores").
        staging_dir: the local working copy of a URL ``dir`` (ranks of one machine share it).
            None: ``~/.cache/nn_handler/checkpoints/<the URL>``.
        storage_options: options for the object store's fsspec filesystem (an endpoint, a
            profile...). Credentials belong in the standard places (environment, config files,
            the machine's role); whatever is here is never logged nor stored in a checkpoint.
        upload_workers: objects each process uploads or downloads at once.
        store_timeout_s: the connect and read timeout of every request to an object store
            (``s3://``: botocore's ``connect_timeout`` and ``read_timeout``; a
            ``config_kwargs`` in ``storage_options`` overrides them). A store that does not
            answer fails an operation after 5 attempts, each retry logged; the last failure is
            a CheckpointError on every rank. The start's probe of the store tries twice, at
            most 20 s each, so that a silent store is named within about a minute.
        store_retry_wait_s: the wait before the first retry of a request to an object store;
            each next one doubles (1 s: 1, 2, 4, 8 s, plus up to half as much at random), so
            a store that refuses connections for a few seconds does not end the run.
        save_last: write periodic checkpoints (the resumable ones, named by latest.json).
        every_n_epochs: write one after every N-th epoch (None: not per epoch).
        every_n_steps: also write one after every N-th optimizer step (None: not per step).
        keep_last: how many periodic checkpoints to keep (the oldest are deleted).
        save_best: keep ``best.pt``, the checkpoint with the best ``monitor`` value so far.
        save_top_k: with save_best, also keep the k best checkpoints by ``monitor`` as
            ``top-e<epoch>-s<step>-<monitor>=<value>.pt`` (Lightning's save_top_k; hard links
            to the epoch's checkpoint where there is one); 1: best.pt alone.
        monitor: the History key save_best watches (e.g. 'val_loss', 'val_accuracy').
        mode: 'min' when lower is better, 'max' when higher is better.
        resume: 'on_restart' resumes from the latest checkpoint when torchrun or SLURM
            restarted the job (TORCHELASTIC_RESTART_COUNT or SLURM_RESTART_COUNT > 0; a
            fault-tolerant member restarted by ``nn-handler supervise``:
            NN_HANDLER_RESTART_COUNT) and
            refuses (ConfigError) a fresh start over committed checkpoints, which would make
            a shorter run the latest; 'auto' resumes whenever ``dir`` holds one, 'never'
            starts afresh (keeping what is there). Both resume only a checkpoint of
            the same run configuration (optimizer and initial learning rate, precision, EMA,
            loader seed and shuffle, accumulation, clipping...): one written by a run that
            differs is refused, naming the fields. 'force' resumes the latest whatever wrote
            it (with a warning naming the differences).
        allow_world_size_change: resuming (``resume`` 'auto'/'on_restart', or ``resume()``
            without the argument) may continue a checkpoint written by another number of
            ranks, with the data re-sharded over the new ranks (a different data order from
            then on; mid-epoch, the rest of the epoch visits each remaining sample once).
        handle_sigterm: on SIGTERM, every rank stops after the current step, writes an
            emergency checkpoint and exits with ``preemption_exit_code``.
        handle_sigint: treat a Ctrl-C (SIGINT) the same way, exiting with status 130
            (TrainingInterrupted); a second Ctrl-C raises KeyboardInterrupt at once, without
            a checkpoint. False: Ctrl-C raises KeyboardInterrupt as usual.
        preemption_check_interval_s: about how often ranks agree on whether a SIGTERM arrived
            (one tiny asynchronous all_reduce per interval, spaced in steps; in one process
            the check is free and runs every step). Ranks stop within about two intervals.
        preemption_budget_s: the longest the emergency checkpoint may take; past it the save is
            abandoned (the previous checkpoint stays the latest) and the run exits anyway.
            None: 25 s under Kubernetes (its default grace period between SIGTERM and SIGKILL
            is 30 s), 120 s elsewhere.
        preemption_exit_code: the exit status of a preempted run (75, EX_TEMPFAIL, by default).
        preemption_notice: a preemption notice that comes without a signal, treated as a
            SIGTERM: 'aws-spot' (the EC2 spot interruption notice, IMDSv2 or v1), a file path
            (a notice once the file exists) or an http(s) URL (a notice once it answers 2xx),
            polled in a thread every ``preemption_notice_interval_s`` seconds. None: signals
            only.
        format: 'file' writes one file (rank 0 writes it, the state gathered to rank 0);
            'sharded' a folder every rank writes its shards into in parallel, through
            torch.distributed.checkpoint, which any number of ranks can resume (see
            docs/checkpoints.md); 'auto' is 'sharded' with ``strategy='fsdp'`` and 'file'
            otherwise.
        async_save: (sharded checkpoints) return to training once every rank has copied its
            state; the files are written in the background, and the next save, the end of
            ``fit`` or a preemption waits for them. The ``latest.json`` pointer moves only
            once the folder is complete. With a URL ``dir`` (single files too), the upload
            runs in the background: the loop's stall is the local write.
        async_writer: deprecated, kept so that earlier configurations still load: the
            background saves run in a thread of the training process. 'process' (a writer
            process per rank) was removed, having measured no gain a user could see
            (docs/checkpoints.md); it is accepted with a warning and saves in the thread.
    """

    dir: str | None = None
    staging_dir: str | None = None
    storage_options: dict[str, Any] | None = Field(default=None, exclude=True, repr=False)
    upload_workers: int = Field(default=8, ge=1, strict=True)
    store_timeout_s: float = Field(default=120.0, gt=0)
    store_retry_wait_s: float = Field(default=1.0, gt=0)
    save_last: StrictBool = True
    every_n_epochs: int | None = Field(default=1, ge=1, strict=True)
    every_n_steps: int | None = Field(default=None, ge=1, strict=True)
    keep_last: int = Field(default=1, ge=1, strict=True)
    save_best: StrictBool = False
    save_top_k: int = Field(default=1, ge=1, strict=True)
    monitor: str = "val_loss"
    mode: Mode = "min"
    resume: ResumePolicy = "on_restart"
    allow_world_size_change: StrictBool = False
    handle_sigterm: StrictBool = True
    handle_sigint: StrictBool = True
    preemption_check_interval_s: float = Field(default=0.5, gt=0)
    preemption_budget_s: float | None = Field(default=None, gt=0)
    preemption_exit_code: int = Field(default=75, ge=1, le=255, strict=True)
    preemption_notice: str | None = Field(default=None, min_length=1)
    preemption_notice_interval_s: float = Field(default=5.0, gt=0)
    format: CheckpointFormat = "auto"
    async_save: StrictBool = False
    async_writer: AsyncWriter = "thread"

    @field_validator("dir")
    @classmethod
    def _a_folder_or_a_url(cls, value: str | None) -> str | None:
        if value is not None:
            problem = location_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _something_to_save(self) -> CheckpointConfig:
        if self.save_last and self.every_n_epochs is None and self.every_n_steps is None:
            raise ValueError(
                "save_last needs every_n_epochs or every_n_steps (or set save_last=False)"
            )
        if self.save_top_k > 1 and not self.save_best:
            raise ValueError(
                f"save_top_k={self.save_top_k} keeps the best checkpoints by monitor "
                f"({self.monitor!r}, mode {self.mode!r}): set save_best=True as well"
            )
        if self.preemption_notice is not None and not self.handle_sigterm:
            raise ValueError(
                "preemption_notice is treated as a SIGTERM: it needs handle_sigterm=True"
            )
        if self.async_save and self.format == "file" and not is_url(self.dir):
            raise ValueError(
                "async_save writes sharded checkpoints in the background; it needs "
                "format='sharded' (or 'auto' with strategy='fsdp')"
            )
        return self


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: A scheme whose ``://`` is misspelt: ``s3:/bucket``, ``s3:bucket``, ``s3//bucket``.
_ALMOST = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)(?::/*|//+)")
#: Object-store schemes: ``s3//bucket`` is a misspelt URL, not a folder named "s3".
_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "hdfs", "webhdfs", "hf",
     "memory", "file", "local", "http", "https", "sftp", "ssh"}
)  # fmt: skip
#: Schemes whose URL has no bucket (``file:///tmp/run``, ``memory://run``).
_BUCKETLESS = frozenset({"file", "local", "memory"})


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a plain path."""
    return isinstance(path, str) and bool(_SCHEME.match(path))


def location_problem(value: str) -> str | None:
    """Why ``value`` is neither a local folder nor a usable object-store URL (None: it is one
    of them): a URL of a scheme fsspec does not know, a URL without a bucket, or a string that
    looks like a URL but is not one (``s3:/bucket``, ``s3//bucket``), which would otherwise
    train into a local folder named ``s3:`` that an ephemeral machine loses."""
    import fsspec  # light: its registry only

    known = set(fsspec.available_protocols()) | _STORES
    if is_url(value):
        scheme, _, rest = value.partition("://")
        if scheme.lower() not in known:
            close = difflib.get_close_matches(scheme.lower(), sorted(known), n=1)
            hint = f"; did you mean {close[0]}://?" if close else "."
            return (
                f"{value!r} has the URL scheme {scheme!r}, which no installed filesystem "
                f"handles{hint} Use s3://, gs://, az://, file://... (an fsspec URL) or a "
                f"local folder."
            )
        if scheme.lower() in _BUCKETLESS:
            if not rest.strip("/"):
                return f"{value!r} names no folder: write {scheme}:///path/to/run."
        elif not rest.split("/", 1)[0]:
            return (
                f"{value!r} has an empty bucket name: write {scheme}://<bucket>/<folder> "
                f"(e.g. {scheme}://my-bucket/run)."
            )
        return None
    almost = _ALMOST.match(value)
    if almost is not None and almost.group(1).lower() in known:
        scheme = almost.group(1)
        if ":" in almost.group(0) or scheme.lower() in _STORES:
            rest = value[almost.end() :]
            return (
                f"{value!r} is a misspelt URL (no '{scheme}://'): as written it is a local "
                f"folder named {value.split('/')[0]!r}, which a machine that goes away takes "
                f"with it. Write {scheme}://{rest or '<bucket>/<folder>'}, or './{value}' "
                f"if you mean a local folder."
            )
    return None


__all__ = ["CheckpointConfig", "CheckpointFormat", "ResumePolicy", "is_url", "location_problem"]
