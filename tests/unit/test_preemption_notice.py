"""A preemption notice without a signal (a file, a URL, the AWS spot notice) stops training
exactly as a SIGTERM does: an emergency checkpoint, latest.json marked preempted,
TrainingPreempted; and the emergency save's default budget fits Kubernetes' grace period."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger
from torch import nn

from nn_handler import ConfigError, HandlerConfig, Hook, NNHandler, TrainingPreempted
from nn_handler.distributed.faults.notice import (
    NoticePoller,
    aws_spot_notice,
    notice_from,
    url_notice,
)
from nn_handler.distributed.faults.preemption import preemption_budget
from nn_handler.training.checkpointing import TrainerCheckpoints
from tests.harness import free_port
from tests.training_helpers import mlp, regression_data, sgd


class NoticeAt(Hook):
    """Gives the notice after optimizer step ``step`` and waits until the watch has seen it,
    so the run stops at that step (the poller runs in its own thread)."""

    def __init__(self, step: int, give: Callable[[], None]) -> None:
        self.step, self.give = step, give

    def after_optimizer_step(self) -> None:
        if self.trainer.state.global_step != self.step:
            return
        self.give()
        watch = self.trainer.checkpointing.hook.watch
        deadline = time.monotonic() + 10
        while not watch.requested and time.monotonic() < deadline:
            time.sleep(0.01)


def _handler(folder: Path, notice: str, hooks: list[Hook]) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {
                "dir": str(folder / "ckpt"),
                "preemption_notice": notice,
                "preemption_notice_interval_s": 0.02,
            },
        }
    )
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks)


def _stopped_at(handler: NNHandler, folder: Path) -> int:
    with handler, pytest.raises(TrainingPreempted) as info:
        handler.train(regression_data(), epochs=5)
    latest = json.loads((folder / "ckpt" / "latest.json").read_text())
    assert latest["reason"] == "preempted" and latest["global_step"] == info.value.global_step
    assert info.value.checkpoint is not None and Path(info.value.checkpoint).exists()
    return info.value.global_step


def test_a_notice_file_stops_training_with_a_checkpoint(tmp_path: Path) -> None:
    marker = tmp_path / "preempt-now"
    hook = NoticeAt(3, marker.touch)
    assert _stopped_at(_handler(tmp_path, str(marker), [hook]), tmp_path) == 3


class Quiet(http.server.BaseHTTPRequestHandler):
    """A request handler that answers with a status and a body, and logs nothing."""

    def answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[Quiet]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 in a thread; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def metadata_server() -> Iterator[tuple[str, threading.Event]]:
    """A local stand-in for a spot instance's metadata: 404 until the notice, then 200."""
    noticed = threading.Event()

    class Answer(Quiet):
        def do_GET(self) -> None:
            self.answer(200 if noticed.is_set() else 404, b'{"action": "terminate"}')

    with serving(Answer) as base:
        yield f"{base}/latest/meta-data/spot/instance-action", noticed


def test_a_notice_url_stops_training_once_it_answers(
    tmp_path: Path, metadata_server: tuple[str, threading.Event]
) -> None:
    url, noticed = metadata_server
    assert url_notice(url)() is False  # 404: no notice yet
    assert _stopped_at(_handler(tmp_path, url, [NoticeAt(4, noticed.set)]), tmp_path) == 4
    assert url_notice("http://127.0.0.1:9/nothing-listens", timeout_s=0.2)() is False


@pytest.fixture
def imdsv2_server() -> Iterator[tuple[str, threading.Event, list[str]]]:
    """A local stand-in of the EC2 metadata service with IMDSv2 required: a PUT to
    /latest/api/token gives a token; a GET without it is 401; with it, 404 until the notice."""
    noticed = threading.Event()
    seen: list[str] = []

    class Metadata(Quiet):
        def do_PUT(self) -> None:
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            ok = self.path == "/latest/api/token" and ttl is not None
            self.answer(200 if ok else 400, b"secret-token")

        def do_GET(self) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            seen.append(f"{self.path} token={token}")
            if token != "secret-token":
                self.answer(401)
            elif self.path != "/latest/meta-data/spot/instance-action" or not noticed.is_set():
                self.answer(404)
            else:
                self.answer(200, b'{"action": "stop", "time": "2026-11-24T16:00:00Z"}')

    with serving(Metadata) as base:
        yield base, noticed, seen


def test_the_aws_spot_source_asks_with_an_imdsv2_token(
    imdsv2_server: tuple[str, threading.Event, list[str]],
) -> None:
    base, noticed, seen = imdsv2_server
    action = f"{base}/latest/meta-data/spot/instance-action"
    poll = aws_spot_notice(base)
    assert poll() is False and seen[-1].endswith("token=secret-token")  # 404: no notice yet
    assert url_notice(action)() is False  # a plain GET is refused (401) where IMDSv2 is required
    noticed.set()
    assert poll() is True
    assert url_notice(action)() is False
    assert notice_from("aws-spot")[1] == "the AWS spot interruption notice"


def test_a_source_that_raises_is_logged_once_and_polled_on() -> None:
    calls: list[int] = []

    def broken() -> bool:
        calls.append(1)
        raise OSError("metadata service unreachable")

    seen: list[str] = []
    logged: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(lambda m: logged.append(str(m)), level="WARNING")
    try:
        poller = NoticePoller(broken, 0.01, lambda: seen.append("notice")).start()
        time.sleep(0.2)
        poller.stop()
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    assert len(calls) > 3 and seen == []  # polled on, never a notice
    assert len([m for m in logged if "metadata service unreachable" in m]) == 1, logged


def test_notice_specs_and_config_errors() -> None:
    source, name = notice_from("https://example.invalid/x")
    assert name == "https://example.invalid/x" and callable(source)
    with pytest.raises(ConfigError, match="'aws-spot', a file path or an http\\(s\\) URL"):
        notice_from("")
    with pytest.raises(ConfigError, match="preemption_notice: String should have at least 1"):
        HandlerConfig.from_dict({"checkpoint": {"dir": "x", "preemption_notice": ""}})
    with pytest.raises(ConfigError, match="needs handle_sigterm=True"):
        HandlerConfig.from_dict(
            {"checkpoint": {"dir": "x", "preemption_notice": "f", "handle_sigterm": False}}
        )


def test_the_default_budget_fits_kubernetes_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert preemption_budget(None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == 25.0
    assert preemption_budget(None, {}) == 120.0
    assert preemption_budget(7.5, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == 7.5
    budgets: list[float | None] = []
    original = TrainerCheckpoints.save_periodic

    def recording(
        self: TrainerCheckpoints, budget_s: float | None = None, final: bool = False
    ) -> Path:
        budgets.append(budget_s)
        return original(self, budget_s=budget_s, final=final)

    monkeypatch.setattr(TrainerCheckpoints, "save_periodic", recording)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    marker = tmp_path / "preempt-now"
    _stopped_at(_handler(tmp_path, str(marker), [NoticeAt(3, marker.touch)]), tmp_path)
    assert budgets[-1] == 25.0  # the emergency save, in a pod


def test_the_aws_spot_source_takes_the_sdks_endpoint_override(
    imdsv2_server: tuple[str, threading.Event, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``preemption_notice: aws-spot`` pointed at a stand-in the way the AWS SDKs are
    (AWS_EC2_METADATA_SERVICE_ENDPOINT): a user can test their spot handling end to end."""
    base, noticed, seen = imdsv2_server
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", base + "/")
    assert notice_from("aws-spot")[1] == f"the AWS spot interruption notice at {base}"
    assert _stopped_at(_handler(tmp_path, "aws-spot", [NoticeAt(4, noticed.set)]), tmp_path) == 4
    assert seen and all(line.endswith("token=secret-token") for line in seen)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "169.254.169.254")
    with pytest.raises(ConfigError, match="is not an http\\(s\\) URL"):
        notice_from("aws-spot")
