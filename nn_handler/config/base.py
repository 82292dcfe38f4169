"""ConfigModel: the base of every config section (frozen, extra fields forbidden), whose
validation errors are ConfigErrors naming each bad field, however the config is built."""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

from nn_handler.errors import ConfigError

_VALIDATING: ContextVar[bool] = ContextVar("nn_handler_config_validating", default=False)


M = TypeVar("M", bound=BaseModel)
C = TypeVar("C", bound="ConfigModel")


class ConfigModel(BaseModel):
    """A frozen pydantic model whose constructor raises ConfigError (a ValueError), not
    pydantic's ValidationError: ``TrainerConfig(epochz=3)`` says which field is unknown and
    which one was probably meant, as a dict or a file would."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        # pydantic calls this __init__ for nested sections too: only the outermost one turns
        # the (merged) ValidationError into a ConfigError.
        token = _VALIDATING.set(True)
        try:
            super().__init__(**data)
        except ValidationError as error:
            if token.old_value is True:
                raise
            raise ConfigError(
                describe_validation_error(error, type(self).__name__, type(self))
            ) from None
        finally:
            _VALIDATING.reset(token)

    @classmethod
    def model_validate(cls: type[C], obj: Any, **options: Any) -> C:
        """pydantic's ``model_validate``, with its errors as the constructor's ConfigError
        (``HandlerConfig.model_validate({...})`` is a common way to build one)."""
        token = _VALIDATING.set(True)
        try:
            return super().model_validate(obj, **options)
        except ValidationError as error:
            if token.old_value is True:
                raise
            raise ConfigError(describe_validation_error(error, cls.__name__, cls)) from None
        finally:
            _VALIDATING.reset(token)


def validate_config(model: type[M], data: Mapping[str, Any], source: str) -> M:
    """``model`` validated from ``data``; a ConfigError naming ``source`` and each bad field
    otherwise."""
    token = _VALIDATING.set(True)
    try:
        return model.model_validate(dict(data))
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source, model)) from None
    finally:
        _VALIDATING.reset(token)


def describe_validation_error(
    error: ValidationError, source: str, model: type[BaseModel] | None = None
) -> str:
    """One line per bad field of ``model`` (``trainer.accumulate_grad_batches: ...``), with a
    "did you mean" for a misspelt field name."""
    lines = [f"invalid {source}:"]
    for item in error.errors():
        loc = item["loc"]
        if len(loc) >= 2 and loc[-1] == loc[-2]:  # a shorthand's one field: `precision: bf61`
            loc = loc[:-1]
        field = ".".join(str(part) for part in loc) or "(root)"
        line = f"  {field}: {item['msg']} (got {item.get('input')!r})"
        if item["type"] == "extra_forbidden" and model is not None:
            line += _suggestion(model, item["loc"])
        lines.append(line)
    return "\n".join(lines)


def _suggestion(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    owner: type[BaseModel] | None = model
    for part in loc[:-1]:
        owner = _section(owner, part) if owner is not None else None
    if owner is None:
        return ""
    fields = sorted(owner.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (fields: {', '.join(fields)})"


def _section(model: type[BaseModel], name: int | str) -> type[BaseModel] | None:
    field = model.model_fields.get(str(name))
    if field is None:
        return None
    annotation = field.annotation
    candidates = (
        get_args(annotation)
        if get_origin(annotation) in (Union, types.UnionType)
        else (annotation,)
    )
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


__all__ = ["ConfigModel", "describe_validation_error", "validate_config"]
