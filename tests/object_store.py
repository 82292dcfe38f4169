"""A real S3 server for tests: moto's threaded server on 127.0.0.1, with its credential checks on.

``s3_server`` (one per test module) starts it and makes an IAM user whose keys are the only
ones it accepts; ``s3`` (per test) exports them the standard way (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION), so this process and every process
it starts reach the server exactly as a user's job reaches S3, and creates a fresh bucket.
Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    key: str
    secret: str

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@dataclass(frozen=True)
class Bucket:
    server: S3Server
    name: str

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def fs(self) -> Any:
        """An s3fs filesystem of the test's own (no cached instance or listing)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=self.server.key,
            secret=self.server.secret,
            endpoint_url=self.server.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
        )


@contextlib.contextmanager
def serving() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port) with one IAM user whose keys are the only
    ones it accepts, for as long as the context lasts (the campaign script uses it too)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        # Credentials are checked from the fourth request on: the three that make the user.
        urllib.request.urlopen(
            urllib.request.Request(
                f"{endpoint}/moto-api/reset-auth",
                data=b"3",
                headers={"Content-Type": "text/plain"},
                method="POST",
            )
        ).read()
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
            region_name="us-east-1",
        )
        user = f"trainer-{uuid.uuid4().hex[:8]}"  # moto's state outlives a server
        iam.create_user(UserName=user)
        key = iam.create_access_key(UserName=user)["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    with serving() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Bucket:
    """A fresh, empty bucket, with the server's credentials exported in the environment (and
    the default working copies of URLs under the test's own folder, not ~/.cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    bucket = Bucket(s3_server, f"my-bucket-{uuid.uuid4().hex[:12]}")  # "bucket" in a name
    bucket.fs().mkdir(bucket.name)
    return bucket


__all__ = ["Bucket", "S3Server", "s3", "s3_server", "serving"]
