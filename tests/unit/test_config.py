"""DistributedConfig validation."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from nn_handler import ConfigError, HandlerConfig
from nn_handler.config import DistributedConfig


def test_defaults_follow_the_seeds() -> None:
    config = DistributedConfig()
    assert config.timeout == timedelta(minutes=60) and config.backend == "auto"
    assert config.enabled is None and not config.debug_collectives


def test_config_is_frozen_and_rejects_unknown_fields() -> None:
    with pytest.raises(ConfigError, match="bakcend"):
        DistributedConfig(bakcend="gloo")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="frozen"):
        DistributedConfig().backend = "gloo"  # type: ignore[misc]


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match="backend"):
        DistributedConfig(backend="tcp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout must be positive"):
        DistributedConfig(timeout=timedelta(0))


def test_timeout_accepts_seconds_and_loads_from_a_dict() -> None:
    config = DistributedConfig.model_validate({"timeout": 30, "device": " CUDA:1 "})
    assert config.timeout == timedelta(seconds=30) and config.device == "cuda:1"


@given(st.text(max_size=12))
def test_device_strings_are_accepted_exactly_when_resolvable(text: str) -> None:
    valid = text.strip().lower() in {"auto", "cpu", "cuda", "gpu", "mps"} or (
        text.strip().lower().partition(":")[0] in {"cuda", "gpu"}
        and text.strip().lower().partition(":")[2].isdigit()
        and text.strip().lower().partition(":")[2].isascii()
    )
    if valid:
        assert DistributedConfig(device=text).device == text.strip().lower()
    else:
        with pytest.raises(ConfigError, match="device"):
            DistributedConfig(device=text)


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("loader", "batch_size", True),
        ("loader", "batch_size", "32"),
        ("loader", "num_workers", 1.0),
        ("trainer", "epochs", "3"),
        ("trainer", "accumulate_grad_batches", False),
        ("checkpoint", "keep_last", "2"),
        ("checkpoint", "every_n_steps", True),
    ],
)
def test_counts_are_strict_integers(section: str, field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{field}: Input should be a valid integer"):
        HandlerConfig.from_dict({section: {field: value}})
    assert HandlerConfig.from_dict({section: {field: 2}}).model_dump()[section][field] == 2


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: HandlerConfig(trainr={}), "trainr: Extra inputs are not permitted"),  # type: ignore[call-arg]
        (lambda: HandlerConfig(trainer={"epochz": 2}), "trainer.epochz: Extra inputs"),
        (
            lambda: HandlerConfig(trainer={"early_stopping": {"monitr": "val_loss"}}),
            "trainer.early_stopping.monitr: Extra inputs",
        ),
        (lambda: HandlerConfig.from_dict({"ema": {"validate": True}}), "ema.validate: Extra"),
    ],
)
def test_a_misspelt_field_in_code_is_a_config_error_with_a_suggestion(
    build: Any, expected: str
) -> None:
    with pytest.raises(ConfigError) as error:
        build()
    message = str(error.value)
    assert expected in message and "did you mean" in message, message
    assert "Value error" not in message, "nested sections are not reported twice"
    assert "pydantic" not in message


def test_every_bad_field_of_nested_sections_is_listed_once() -> None:
    with pytest.raises(ConfigError) as error:
        HandlerConfig(trainer={"early_stopping": {"patience": 0}}, loader={"batch_size": -1})
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid HandlerConfig:"
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == [
        "loader.batch_size",
        "trainer.early_stopping.patience",
    ]
