"""Lossless conversion between the core's attrs values and JSON-compatible data.

Driven by the field annotations, so every value type (plans, specs, snapshots, configs)
round-trips without a hand-written converter each: attrs classes become objects keyed by
field name, enums their values, tuples and frozensets lists (frozensets sorted), and the
way back rebuilds them through their constructors, so every validator runs again.

`parse_json` reads the text of such data as a reader of untrusted files must: bounded
nesting and number sizes, no duplicate keys, no NaN or Infinity, and every failure a
`PlanError`, never a RecursionError or a ValueError from deep inside `json`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
import math
import reprlib
import types
import typing
from typing import Any, TypeVar, Union

import attrs

from offload.errors import PlanError

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "from_data", "parse_json", "short_repr", "to_data"]

#: The deepest nesting of arrays and objects `parse_json` reads; a plan document nests 6
#: deep, and anything far deeper is refused before the parser recurses into it.
MAX_JSON_DEPTH = 32

#: The most digits an integer may have: no count, size, index or byte total needs more,
#: and converting a longer one is slow (quadratic) where Python's own limit is lifted.
MAX_INT_DIGITS = 100

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlong = 40
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset"):
    setattr(_REPR, _attr, 8)


def short_repr(value: object) -> str:
    """`repr` cut to a few hundred characters, for error messages about untrusted data."""
    return _REPR.repr(value)

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
    return PlanError(f"{path}: expected {expected}, got {short_repr(data)}", name=path, value=data)


@functools.cache
def _fields_of(cls: type[attrs.AttrsInstance]) -> tuple[tuple[tuple[str, Any, bool], ...], frozenset[str]]:
    """(name, type hint, required) of each field, and the names; resolving the hints is
    most of the cost of reading a large plan, so it is done once per class."""
    hints = typing.get_type_hints(cls)
    fields = tuple((f.name, hints[f.name], f.default is attrs.NOTHING) for f in attrs.fields(cls))
    return fields, frozenset(name for name, _hint, _required in fields)


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
        fields, names = _fields_of(hint)
        unknown = sorted(set(data) - names)
        if unknown:
            raise _fail(path, f"only the fields of {hint.__name__}", unknown)
        missing = [name for name, _hint, required in fields if required and name not in data]
        if missing:
            raise _fail(path, f"every required field of {hint.__name__} (missing {', '.join(missing)})", data)
        kwargs = {
            name: _build(field_hint, data[name], f"{path}.{name}")
            for name, field_hint, _required in fields
            if name in data
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
        try:
            number = float(data)
        except OverflowError:  # an int beyond the float range
            raise _fail(path, "a finite number", data) from None
        if not math.isfinite(number):
            raise _fail(path, "a finite number", data)
        return number
    if hint is str:
        if not isinstance(data, str):
            raise _fail(path, "a string", data)
        return data
    raise _fail(path, f"a type the serialiser knows (not {hint!r})", data)


# ---- reading JSON text ---------------------------------------------------------------------

_NOT_BRACKETS_OR_QUOTES = bytes(range(256)).translate(None, b'[]{}"')  # every other byte, to delete
_BRACES_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")  # for depth, the kind of bracket does not matter
_DEPTH_STEP = {ord("["): 1, ord("]"): -1}


def _nesting_depth_exceeds(text: str, limit: int) -> int | None:
    """None when `text` nests arrays and objects at most `limit` deep, else a depth above
    `limit` that it reaches; without parsing, in C over the text.

    Only brackets and the quotes that delimit strings are kept (what is inside a string
    does not count), then adjacent pairs are peeled off, pass after pass: a pair peeled in
    pass k encloses k levels, so progress in pass ``limit + 1`` proves the text too deep.
    What is left when no pair is adjacent (unclosed openers, stray closers) is measured.
    """
    raw = text.encode("utf-8", "surrogatepass")
    # Escaped backslashes first, so that what is left of a backslash escapes one character.
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = raw.translate(_BRACES_AS_BRACKETS, _NOT_BRACKETS_OR_QUOTES)
    brackets = b"".join(kept.split(b'"')[::2])  # outside strings only
    for _ in range(limit + 1):
        if not brackets:
            return None
        peeled = brackets.replace(b"[]", b"")  # exactly the innermost level
        if len(peeled) == len(brackets):
            break
        brackets = peeled
    else:
        return limit + 1
    depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    return depth if depth > limit else None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise PlanError(f"JSON object has the key {short_repr(key)} twice; which one is meant is "
                                "ambiguous", name=key, value=key)
            seen.add(key)
    return result


def _constant(name: str) -> Any:
    raise PlanError(f"JSON has {name}, which is not a JSON number; plans hold finite numbers only",
                    name="json", value=name)


def _float(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise PlanError(f"JSON number {short_repr(literal)} is too large for a float",
                        name="json", value=literal[:100])
    return number


def _int(literal: str) -> int:
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise PlanError(f"JSON integer {short_repr(literal)} has {digits} digits, more than the "
                        f"{MAX_INT_DIGITS} any plan needs", name="json", value=literal[:100])
    return int(literal)


def parse_json(text: str | bytes | bytearray) -> Any:
    """Parse untrusted JSON text into data for `from_data`.

    Args:
        text: the document; bytes are decoded as `json.loads` decodes them (UTF-8, -16 or -32).

    Returns:
        The data: dicts, lists, strings, ints, finite floats, booleans and None.

    Raises:
        PlanError: naming what is wrong: not text, not JSON, nested deeper than
            `MAX_JSON_DEPTH` (refused before parsing), an integer longer than
            `MAX_INT_DIGITS` digits, NaN or Infinity, a float out of range, or a key twice
            in one object.
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
        except (UnicodeDecodeError, LookupError) as exc:
            raise PlanError(f"plan JSON is not text: {exc}", name="json", value=None) from exc
    if not isinstance(text, str):
        raise PlanError(f"plan JSON must be a str or bytes, got a {type(text).__name__}",
                        name="text", value=short_repr(text))
    depth = _nesting_depth_exceeds(text, MAX_JSON_DEPTH)
    if depth is not None:
        raise PlanError(f"plan JSON nests {depth} deep, deeper than the {MAX_JSON_DEPTH} a plan could need",
                        name="json", value=depth)
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_constant, parse_float=_float,
                          parse_int=_int)
    except PlanError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise PlanError(f"plan JSON does not parse: {short_repr(str(exc))}", name="json", value=None) from exc
