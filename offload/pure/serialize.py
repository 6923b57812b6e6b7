"""Lossless conversion between the core's attrs values and JSON-compatible data.

Driven by the field annotations, so every value type (plans, specs, snapshots, configs)
round-trips without a hand-written converter each: attrs classes become objects keyed by
field name, enums their values, tuples and frozensets lists (frozensets sorted), and the
way back rebuilds them through their constructors, so every validator runs again.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, TypeVar, Union

import attrs

from offload.errors import PlanError

__all__ = ["from_data", "to_data"]

T = TypeVar("T")


def to_data(value: object) -> Any:
    """Turn an attrs value (and whatever it holds) into JSON-compatible data."""
    if attrs.has(type(value)):
        cls = typing.cast("type[attrs.AttrsInstance]", type(value))
        return {f.name: to_data(getattr(value, f.name)) for f in attrs.fields(cls)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [to_data(v) for v in value]
    if isinstance(value, frozenset):
        return sorted(to_data(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PlanError(f"cannot serialise a {type(value).__name__}: {value!r}",
                    name=type(value).__name__, value=value)


def from_data(cls: type[T], data: Any) -> T:
    """Rebuild an attrs value of type `cls` from `to_data` output.

    Raises:
        PlanError: the data does not have the shape `cls` needs; the message gives the
            path to the first bad part (``plan.params[3].shape``). A validator's own
            error (ConfigError, PlanError) passes through unchanged.
    """
    result: T = _build(cls, data, cls.__name__)
    return result


def _fail(path: str, expected: str, data: Any) -> PlanError:
    return PlanError(f"{path}: expected {expected}, got {data!r}", name=path, value=data)


def _build(hint: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _build(option, data, path)
            except PlanError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is typing.Literal:
        if data not in args:
            raise _fail(path, f"one of {args}", data)
        return data
    if origin is tuple:
        if not isinstance(data, list):
            raise _fail(path, "a list", data)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise _fail(path, f"a list of {len(args)}", data)
        return tuple(_build(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin is frozenset:
        if not isinstance(data, list):
            raise _fail(path, "a list", data)
        return frozenset(_build(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
    if isinstance(hint, type) and attrs.has(hint):
        if not isinstance(data, dict):
            raise _fail(path, f"an object for {hint.__name__}", data)
        hints = typing.get_type_hints(hint)
        fields = attrs.fields(hint)
        names = {f.name for f in fields}
        unknown = sorted(set(data) - names)
        if unknown:
            raise _fail(path, f"only the fields of {hint.__name__}", unknown)
        missing = [f.name for f in fields if f.name not in data and f.default is attrs.NOTHING]
        if missing:
            raise _fail(path, f"every required field of {hint.__name__} (missing {', '.join(missing)})", data)
        kwargs = {
            f.name: _build(hints[f.name], data[f.name], f"{path}.{f.name}")
            for f in fields
            if f.name in data
        }
        return hint(**kwargs)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(data)
        except ValueError:
            raise _fail(path, f"a {hint.__name__} value", data) from None
    if hint is bool:
        if not isinstance(data, bool):
            raise _fail(path, "true or false", data)
        return data
    if hint is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise _fail(path, "an integer", data)
        return data
    if hint is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise _fail(path, "a number", data)
        return float(data)
    if hint is str:
        if not isinstance(data, str):
            raise _fail(path, "a string", data)
        return data
    raise _fail(path, f"a type the serialiser knows (not {hint!r})", data)
