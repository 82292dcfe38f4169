"""Preemption notices that come without a signal: a file that appears, or a URL that starts
to answer (AWS spot instances get a two-minute notice from the instance metadata service,
and no SIGTERM before the end). A daemon thread polls the source; the first notice is
treated exactly like a SIGTERM (``PreemptionWatch``: the ranks agree to stop, an emergency
checkpoint is written), so polling never blocks a training step.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from loguru import logger

from nn_handler.errors import ConfigError

NoticeSource = Callable[[], bool]


def file_notice(path: str | Path) -> NoticeSource:
    """A notice once ``path`` exists (a scheduler's or a sidecar's marker file)."""
    target = Path(path)
    return target.exists


def url_notice(url: str, timeout_s: float = 1.0) -> NoticeSource:
    """A notice once a GET of ``url`` answers 2xx; 404, other errors and timeouts are no
    notice (for AWS spot, 'aws-spot' also handles IMDSv2's session token)."""

    def poll() -> bool:
        return _answers(url, timeout_s)

    return poll


#: The EC2 instance metadata service, where a spot instance finds its interruption notice.
AWS_METADATA = "http://169.254.169.254"
AWS_SPOT_NOTICE = "aws-spot"
#: Where the AWS SDKs (botocore, the CLI, Java, Go) read another metadata endpoint from.
AWS_METADATA_ENDPOINT = "AWS_EC2_METADATA_SERVICE_ENDPOINT"


def aws_spot_notice(base: str = AWS_METADATA, timeout_s: float = 1.0) -> NoticeSource:
    """A notice once ``latest/meta-data/spot/instance-action`` answers 2xx (AWS gives it two
    minutes before a spot instance is stopped). Each poll asks for an IMDSv2 session token
    first (PUT ``latest/api/token``) and sends it; where that fails (IMDSv1 only) the GET goes
    without one."""

    def poll() -> bool:
        headers: dict[str, str] = {}
        ask = urllib.request.Request(
            f"{base}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
        )
        try:
            with urllib.request.urlopen(ask, timeout=timeout_s) as answer:
                headers["X-aws-ec2-metadata-token"] = answer.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            pass
        action = urllib.request.Request(
            f"{base}/latest/meta-data/spot/instance-action", headers=headers
        )
        return _answers(action, timeout_s)

    return poll


def _answers(request: urllib.request.Request | str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return 200 <= int(answer.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def notice_from(
    spec: str | NoticeSource, env: Mapping[str, str] | None = None
) -> tuple[NoticeSource, str]:
    """The source ``spec`` names ('aws-spot', an http(s) URL, a file path, or a callable
    returning True once the notice came) and how to name it in a log line. 'aws-spot' asks
    the metadata service at ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` when ``env`` (default: the
    environment) sets it, as the AWS SDKs do: a stand-in for tests, a proxy."""
    if callable(spec):
        return spec, getattr(spec, "__name__", type(spec).__name__)
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f"preemption_notice must be 'aws-spot', a file path or an http(s) URL, got {spec!r}."
        )
    if spec == AWS_SPOT_NOTICE:
        endpoint = (os.environ if env is None else env).get(AWS_METADATA_ENDPOINT, "")
        if not endpoint:
            return aws_spot_notice(), "the AWS spot interruption notice"
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"{AWS_METADATA_ENDPOINT}={endpoint!r} is not an http(s) URL (e.g. "
                f"http://127.0.0.1:1338); fix it or unset it for the real metadata service."
            )
        base = endpoint.rstrip("/")
        return aws_spot_notice(base), f"the AWS spot interruption notice at {base}"
    if spec.startswith(("http://", "https://")):
        return url_notice(spec), spec
    return file_notice(spec), spec


class NoticePoller:
    """Calls ``source`` every ``interval_s`` seconds in a daemon thread until it returns True,
    then ``on_notice()`` once. A source that raises is logged once and polled on."""

    def __init__(
        self, source: NoticeSource, interval_s: float, on_notice: Callable[[], None]
    ) -> None:
        self.source = source
        self.interval_s = interval_s
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nn-handler-notice", daemon=True)
        self._failed = False

    def start(self) -> NoticePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2 * self.interval_s, 1.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._poll():
                self.on_notice()
                return
            self._stop.wait(self.interval_s)

    def _poll(self) -> bool:
        try:
            return bool(self.source())
        except Exception as error:  # a broken source must not end the training
            if not self._failed:
                logger.warning("the preemption notice source raised {!r}; polling on", error)
                self._failed = True
            return False


__all__ = [
    "AWS_METADATA_ENDPOINT",
    "AWS_METADATA",
    "AWS_SPOT_NOTICE",
    "NoticePoller",
    "NoticeSource",
    "aws_spot_notice",
    "file_notice",
    "notice_from",
    "url_notice",
]
