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


def test_defaults() -> None:
    config = DistributedConfig()
    # The watchdog reports a stall well before the process group gives up without a report.
    assert config.timeout == timedelta(minutes=30)
    assert config.stall_timeout == timedelta(minutes=5)
    assert config.backend == "auto"
    assert config.enabled is None and not config.debug_collectives


def test_stall_timeout_is_shorter_than_the_timeout() -> None:
    # Only a short timeout given: the default stall timeout becomes half of it.
    assert DistributedConfig(timeout=60).stall_timeout == timedelta(seconds=30)
    assert DistributedConfig(timeout=3600).stall_timeout == timedelta(minutes=5)
    assert DistributedConfig(stall_timeout=None).stall_timeout is None
    assert DistributedConfig(stall_timeout=2.5).stall_timeout == timedelta(seconds=2.5)
    with pytest.raises(ConfigError, match=r"stall_timeout .* must be shorter than timeout"):
        DistributedConfig(timeout=60, stall_timeout=60)
    with pytest.raises(ConfigError, match="stall_timeout must be positive"):
        DistributedConfig(stall_timeout=0)


@given(st.integers(1, 10**6), st.one_of(st.none(), st.integers(1, 10**6)))
def test_a_valid_config_always_has_its_stall_before_its_timeout(
    timeout: int, stall: int | None
) -> None:
    fields: dict[str, Any] = {"timeout": timeout}
    if stall is not None:
        fields["stall_timeout"] = stall
    try:
        config = DistributedConfig(**fields)
    except ConfigError:
        assert stall is not None and stall >= timeout
        return
    assert config.stall_timeout is not None and config.stall_timeout < config.timeout


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


def test_model_validate_gives_the_constructors_config_error() -> None:
    """pydantic's own entry point says what the constructor says, not a raw ValidationError."""
    with pytest.raises(ConfigError, match=r"trainer\.epochz: .*did you mean 'epochs'"):
        HandlerConfig.model_validate({"trainer": {"epochz": 3}})
    assert HandlerConfig.model_validate({"trainer": {"epochs": 3}}).trainer.epochs == 3


def test_lightnings_numeric_precision_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"'32', 'bf16', 'fp16' or 'amp' \(got '16'\)"):
        HandlerConfig.from_dict({"precision": 16})
    assert HandlerConfig.from_dict({"precision": 32}).precision.precision == "32"


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("checkpoint", "async_save", "yes"),
        ("checkpoint", "save_best", "false"),  # true in Python's sense, false in pydantic's
        ("loader", "shuffle", 0),
        ("trainer", "progress_bar", 1),
        ("ema", "enabled", "on"),
        ("loader", "pin_memory", "true"),  # bool | None
    ],
)
def test_yes_no_fields_take_booleans_only_as_counts_take_integers(
    section: str, field: str, value: object
) -> None:
    """Issue 69, item 11: ``async_save: "yes"`` was accepted while ``batch_size: "64"`` was
    refused."""
    with pytest.raises(ConfigError, match=rf"{section}\.{field}: Input should be a valid boolean"):
        HandlerConfig.from_dict({section: {field: value}})
    assert HandlerConfig.from_dict({section: {field: False}}).model_dump()[section][field] is False


def test_a_bad_precision_shorthand_is_named_as_written() -> None:
    """``precision: bf61`` is the top-level field the user wrote, not 'precision.precision'."""
    with pytest.raises(ConfigError) as error:
        HandlerConfig.from_dict({"precision": "bf61"})
    assert str(error.value).splitlines()[1].startswith("  precision: Input should be '32'")
    assert HandlerConfig.from_dict({"trainer": {"compile": "blocks"}}).trainer.compile == "blocks"
