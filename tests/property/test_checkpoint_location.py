"""checkpoint.dir: a local folder or a usable object-store URL, never a misspelt URL that would
silently train into a local folder named ``s3:`` (config/checkpoint.py ``location_problem``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler import ConfigError, NNHandler
from nn_handler.config import CheckpointConfig
from nn_handler.config.checkpoint import location_problem
from tests import resume_helpers as rh

SCHEMES = ["s3", "gs", "gcs", "az", "abfs", "memory", "file"]
segment = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
folders = st.lists(segment, min_size=0, max_size=3).map("/".join)


@given(st.sampled_from(["s3", "gs", "gcs", "az", "abfs"]), segment, folders)
def test_a_store_url_with_a_bucket_is_accepted(scheme: str, bucket: str, folder: str) -> None:
    url = f"{scheme}://{bucket}/{folder}".rstrip("/")
    assert location_problem(url) is None
    assert CheckpointConfig(dir=url).dir == url


@given(st.sampled_from(SCHEMES), segment, folders, st.sampled_from([":/", ":", "//"]))
def test_a_misspelt_url_is_refused_naming_the_fix(
    scheme: str, bucket: str, folder: str, separator: str
) -> None:
    value = f"{scheme}{separator}{bucket}/{folder}".rstrip("/")
    problem = location_problem(value)
    assert problem is not None
    assert "misspelt URL" in problem and f"Write {scheme}://{bucket}" in problem


@given(st.lists(segment, min_size=1, max_size=4).map("/".join), st.booleans())
def test_a_local_folder_is_accepted(path: str, absolute: bool) -> None:
    value = f"/{path}" if absolute else path
    if value.split("/")[0].lower() in {"s3", "gs", "az", "file", "memory"}:
        value = f"./{value}"  # a folder named like a scheme: say it is a path
    assert location_problem(value) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("s3:/bucket/run", r"'s3:/bucket/run' is a misspelt URL .* local folder named 's3:'.* "
                           r"Write s3://bucket/run"),
        ("s3//bucket/run", r"misspelt URL .* Write s3://bucket/run"),
        ("sss3://bucket/run", r"scheme 'sss3', which no installed filesystem handles; did you "
                              r"mean s3://"),
        ("zzqx://bucket/run", r"scheme 'zzqx', which no installed filesystem handles\. Use s3://"),
        ("s3:///run", r"'s3:///run' has an empty bucket name: write s3://<bucket>/<folder>"),
        ("gs://", r"empty bucket name"),
        ("file://", r"names no folder: write file:///path/to/run"),
    ],
)  # fmt: skip
def test_each_bad_location_is_a_config_error(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.dir|dir") as caught:
        CheckpointConfig(dir=value)
    assert caught.match(says)


def test_a_handler_refuses_a_misspelt_url_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: .*misspelt URL"):
        NNHandler(rh.model(), rh.adam, config={"checkpoint": {"dir": "s3:/bucket/run"}})
    assert list(tmp_path.iterdir()) == []  # no folder named 's3:'
