"""Small helpers of the communicator modules: the debug switch, timeouts, error texts."""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from datetime import timedelta

from nn_handler.errors import ConfigError

DEBUG_ENV_VAR = "NN_HANDLER_DEBUG_COLLECTIVES"


def debug_from_env(env: Mapping[str, str] | None = None) -> bool:
    """True when ``NN_HANDLER_DEBUG_COLLECTIVES`` is set to 1/true/yes/on."""
    value = (env if env is not None else os.environ).get(DEBUG_ENV_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def to_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    """Seconds or a timedelta, validated to be positive."""
    if timeout is None:
        return None
    delta = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if delta.total_seconds() <= 0:
        raise ConfigError(f"timeout must be positive, got {timeout!r}.")
    return delta


def format_error(error: BaseException) -> str:
    """The error's type, message and traceback as text, to send to other ranks."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


__all__ = ["DEBUG_ENV_VAR", "debug_from_env", "format_error", "to_timedelta"]
