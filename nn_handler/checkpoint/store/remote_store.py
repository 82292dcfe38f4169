"""RemoteStore: one folder of an object store (an fsspec URL) with the few operations checkpoints
need. Every request has a timeout; tenacity is the one retry layer (transient errors, backoff
with jitter, one warning per retry); what retrying cannot fix is a CheckpointError naming the
object and the fix at once. Credentials are never logged.
"""

from __future__ import annotations

import copy
import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import tenacity
from loguru import logger

from nn_handler.errors import CheckpointError, ConfigError

T = TypeVar("T")

#: The chunk a download is read in.
CHUNK = 8 << 20

#: Errors no retry can fix: they are raised at the first attempt.
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    CheckpointError,
)
#: The connect and read timeout of every request, unless the configuration says.
DEFAULT_TIMEOUT_S = 120.0
#: The start's probe (``check``): a store that never answers is named within about a minute
#: (two tries of at most 20 s each), whatever the timeout of the requests during training.
PROBE_TIMEOUT_S = 20.0
PROBE_ATTEMPTS = 2


def transient(error: BaseException) -> bool:
    """An error worth retrying: a connection or I/O failure that is not a permanent one."""
    if isinstance(error, _PERMANENT):
        return False
    if isinstance(error, (OSError, ConnectionError, TimeoutError)):
        return True
    name = type(error).__name__
    return any(word in name for word in ("Connection", "Timeout", "Throttl", "ClientPayload"))


class MissingObject(CheckpointError):
    """The object asked for does not exist (its bucket does)."""


class RemoteStore:
    """The folder ``url`` of an object store.

    Args:
        url: the folder's URL.
        storage_options: passed to the fsspec filesystem (an endpoint, a profile...).
        attempts: tries per operation before a transient error is final.
        first_wait_s: the first backoff; each next doubles (plus up to half, at random), up
            to 16 times it.
        timeout_s: the connect and read timeout of every request.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        attempts: int = 5,
        first_wait_s: float = 1.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.attempts = attempts
        self.first_wait_s = first_wait_s
        self.timeout_s = timeout_s
        self.storage_options = dict(storage_options or {})
        try:
            # A filesystem of its own: a cached one would keep credentials the environment
            # no longer has, and its listings.
            options = {"skip_instance_cache": True, **dict(storage_options or {})}
            options = with_timeouts(self.url, options, timeout_s)
            if self.url.startswith(("file://", "local://")):  # folders appear as objects do
                options.setdefault("auto_mkdir", True)
            self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as error:
            raise ConfigError(
                f"checkpoint.dir {self.url}: {error}. Install the filesystem for this scheme "
                f"(s3://: pip install s3fs; gs://: gcsfs; az://: adlfs)."
            ) from None
        except ValueError as error:
            raise ConfigError(f"checkpoint.dir {self.url}: {error}") from None
        self.root = str(root).rstrip("/")
        if self.url.startswith(("s3://", "s3a://")):
            _bound_every_s3_wait(self.fs)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_exponential_jitter(
                initial=first_wait_s, max=16 * first_wait_s, jitter=first_wait_s / 2
            ),
            retry=tenacity.retry_if_exception(transient),
            reraise=True,
        )

    def once(self) -> RemoteStore:
        """This store with one attempt per operation (best-effort cleanup on the way out,
        where a dead store must not cost ``attempts`` timeouts)."""
        single = copy.copy(self)
        single.attempts = 1
        single._retrying = self._retrying.copy(stop=tenacity.stop_after_attempt(1))
        return single

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, what: str, name: str, action: Callable[[], T]) -> T:
        """``action()`` retried on transient errors; any failure a CheckpointError naming the
        object, the cause and the fix."""

        def warn(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            logger.warning(
                "object store: cannot {} {} (attempt {} of {}: {}: {}); retrying in {:.1f} s",
                what, self.url_of(name), state.attempt_number, self.attempts,
                type(error).__name__, _first(error) if error else "", wait,
            )  # fmt: skip

        try:
            return self._retrying.copy(before_sleep=warn)(action)
        except FileNotFoundError as error:
            gone = CheckpointError if _names_bucket(error) else MissingObject
            raise gone(self._missing(what, name, error)) from None
        except PermissionError as error:
            raise CheckpointError(self._denied(what, name, error)) from None
        except CheckpointError:
            raise
        except Exception as error:
            if "Credential" in type(error).__name__:  # none found, or only some of them
                raise CheckpointError(self._denied(what, name, error)) from None
            raise CheckpointError(
                f"cannot {what} {self.url_of(name)}: {type(error).__name__}: {_first(error)} "
                f"(after {self.attempts} attempts). Check that the store answers (its endpoint, "
                f"the network); checkpoint.store_timeout_s bounds each request."
            ) from error

    def _maybe(self, what: str, name: str, action: Callable[[], T]) -> T | None:
        """As ``_call``, with None when the object does not exist (a missing bucket is still
        an error)."""

        def missing_is_none() -> T | None:
            try:
                return action()
            except FileNotFoundError as error:
                if _names_bucket(error):
                    raise
                return None

        return self._call(what, name, missing_is_none)

    def _missing(self, what: str, name: str, error: BaseException) -> str:
        text = _first(error)
        if _names_bucket(error):
            return (
                f"cannot {what} {self.url_of(name)}: the bucket of {self.url} does not exist "
                f"({text}). Create it (e.g. aws s3 mb), or fix checkpoint.dir."
            )
        return f"cannot {what} {self.url_of(name)}: it does not exist ({text})."

    def _denied(self, what: str, name: str, error: BaseException) -> str:
        return (
            f"cannot {what} {self.url_of(name)}: access denied ({_first(error)}). The "
            f"credentials come from the standard places: environment variables (e.g. "
            f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE, "
            f"GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*), the library's config files, "
            f"the machine's role, or checkpoint.storage_options; check them and the bucket's "
            f"policy."
        )

    # ----------------------------------------------------------------- objects
    def put(self, local: Path, name: str) -> None:
        """Upload the file ``local`` as the object ``name``."""
        self._call("upload", name, lambda: self.fs.put_file(str(local), self._key(name)))

    def get(self, name: str, local: Path, seen: Callable[[bytes], None]) -> None:
        """Download the object ``name`` into the file ``local``, each chunk shown to ``seen``
        as it arrives (the verifier's checksum: nothing reads the file back)."""
        local.parent.mkdir(parents=True, exist_ok=True)

        def download() -> None:
            with self.fs.open(self._key(name), "rb") as source, open(local, "wb") as target:
                while chunk := source.read(CHUNK):
                    seen(chunk)
                    target.write(chunk)

        self._call("download", name, download)

    def read(self, name: str) -> bytes | None:
        """The bytes of the object ``name``; None when it does not exist."""
        return self._maybe("read", name, lambda: bytes(self.fs.cat_file(self._key(name))))

    def write(self, name: str, data: bytes) -> None:
        """Write ``data`` as the object ``name`` (one PUT: readers see all of it or nothing)."""
        self._call("write", name, lambda: self.fs.pipe_file(self._key(name), data))

    def create(self, name: str, data: bytes) -> bool:
        """Write ``data`` as the object ``name`` only if none exists (one conditional PUT:
        S3's ``If-None-Match: *``); whether it was created. NotImplementedError where the
        filesystem cannot write conditionally."""

        def attempt() -> bool:
            try:
                self.fs.pipe_file(self._key(name), data, mode="create")
            except FileExistsError:
                return False
            except TypeError as error:  # a filesystem whose pipe_file knows no mode
                raise NotImplementedError(str(error)) from None
            return True

        try:
            return self._call("create", name, attempt)
        except CheckpointError as error:
            if isinstance(error.__cause__, NotImplementedError):
                raise error.__cause__ from None
            raise

    def age(self, name: str) -> float | None:
        """Seconds since the object ``name`` was last written, by the store's own clock (a
        probe object is written to read the store's time now: no machine's clock enters);
        None when the store gives no times or ``name`` is missing."""
        probe = f".nn_handler-clock-{os.getpid()}"
        self.write(probe, b"now")
        try:
            written, now = self._modified(name), self._modified(probe)
        finally:
            self.remove(probe)
        return None if written is None or now is None else max(0.0, now - written)

    def _modified(self, name: str) -> float | None:
        def info() -> Any:
            self.fs.invalidate_cache()
            return self.fs.info(self._key(name))

        try:
            found = self._call("read the time of", name, info)
        except MissingObject:
            return None
        when = found.get("LastModified", found.get("mtime", found.get("created")))
        if isinstance(when, datetime.datetime):
            return when.timestamp()
        return float(when) if isinstance(when, (int, float)) else None

    def copy(self, source: str, target: str) -> None:
        """Copy the object ``source`` to ``target`` (server-side where the store can)."""
        self._call("copy", source, lambda: self.fs.copy(self._key(source), self._key(target)))

    def remove(self, name: str) -> None:
        """Delete the object ``name`` (missing is fine)."""
        self._maybe("delete", name, lambda: self.fs.rm_file(self._key(name)))

    def listing(self) -> dict[str, int]:
        """Every object under the folder: its name relative to the folder, and its size."""

        def walk() -> dict[str, int]:
            self.fs.invalidate_cache()
            if not self.fs.exists(self.root):
                return {}
            found = self.fs.find(self.root, detail=True)
            prefix = f"{self.root}/"
            return {
                str(key)[len(prefix) :]: int(info.get("size") or 0)
                for key, info in found.items()
                if str(key).startswith(prefix) and info.get("type", "file") == "file"
            }

        return self._call("list", "", walk)

    def check(self) -> None:
        """Write and delete a probe object in ``PROBE_ATTEMPTS`` tries of at most
        ``PROBE_TIMEOUT_S``: a CheckpointError with the cause and the fix when it cannot."""
        timeout_s = min(self.timeout_s, PROBE_TIMEOUT_S)
        probing = RemoteStore(
            self.url, self.storage_options, min(self.attempts, PROBE_ATTEMPTS),
            self.first_wait_s, timeout_s,
        )  # fmt: skip
        probe = f".nn_handler-probe-{os.getpid()}"
        probing.write(probe, b"probe")
        probing.remove(probe)


def with_timeouts(url: str, options: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """``options`` for the filesystem of ``url`` with connect and read timeouts of
    ``timeout_s`` and the library's own retries off, where the user's options do not set
    them (``s3://``: botocore's Config; other schemes: their library's defaults)."""
    found = dict(options)
    if url.startswith(("s3://", "s3a://")):
        config = dict(found.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)
        config.setdefault("retries", {"total_max_attempts": 1})
        found["config_kwargs"] = config
    return found


def _bound_every_s3_wait(fs: Any) -> None:
    """Bound every wait of s3fs's client by botocore's timeout: s3fs's retries off, and no
    ``Expect: 100-continue`` (aiohttp waits for it without a timeout; botocore#3613)."""
    from botocore.handlers import add_expect_header

    fs.retries = 1
    fs.connect()
    fs.s3.meta.events.unregister("before-call.s3", add_expect_header)


#: How the stores say that the bucket (container) itself is missing. A missing object's
#: error names its path, which may well contain "bucket" (s3://my-bucket/...): the words
#: must be the store's own.
_NO_BUCKET = ("bucket does not exist", "nosuchbucket", "container does not exist",
              "containernotfound", "bucket not found")  # fmt: skip


def _names_bucket(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _NO_BUCKET)


def _first(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MissingObject",
    "RemoteStore",
    "transient",
    "with_timeouts",
]
