"""Attrs validators shared by the value types of the pure core.

Each raises the error class its caller names, with the field name and the bad value, so
that a mistake surfaces at construction rather than deep inside an executor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

import attrs

from offload.errors import OffloadError

__all__ = [
    "VOLATILE",
    "check_int_at_least",
    "check_positive_number",
    "fraction",
    "int_at_least",
    "is_bool",
    "is_int",
    "is_positive_number",
    "is_str",
    "non_empty_str",
    "one_of",
    "positive_number",
    "tuple_of",
    "tuple_of_ints",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

#: Field metadata key marking a reading that changes from moment to moment (free memory,
#: a cgroup's usage); such fields are left out of `EnvSnapshot.fingerprint`. Here, not in
#: `offload.pure.env.snapshot`, because the values `Platform` holds mark fields with it too.
VOLATILE = "offload.volatile"


def is_int(value: object) -> TypeGuard[int]:
    """True for ints that are not bools."""
    # bool is an int subclass; True as a layer count is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_number(value: object) -> bool:
    """True for finite ints and floats > 0 (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_int_at_least(
    name: str, value: object, minimum: int, error: type[OffloadError], *, optional: bool = False
) -> None:
    """Raise `error` naming `name` unless `value` is an int (not a bool) that is at least
    `minimum` (or None when `optional`); for function arguments, as `int_at_least` is for
    fields."""
    if optional and value is None:
        return
    if not is_int(value) or value < minimum:
        raise error(
            f"{name} must be {'None or ' if optional else ''}an integer >= {minimum}, got {value!r}",
            name=name,
            value=value,
        )


def check_positive_number(name: str, value: object, error: type[OffloadError], *, optional: bool = False) -> None:
    """Raise `error` naming `name` unless `value` is a finite int or float > 0 (or None
    when `optional`); for function arguments, as `positive_number` is for fields."""
    if optional and value is None:
        return
    if not is_positive_number(value):
        raise error(
            f"{name} must be {'None or ' if optional else ''}a finite number > 0, got {value!r}",
            name=name,
            value=value,
        )


def int_at_least(minimum: int, error: type[OffloadError], *, optional: bool = False) -> Validator:
    """A validator accepting ints (not bools) that are at least `minimum` (and None when
    `optional`)."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_int_at_least(attribute.name, value, minimum, error, optional=optional)

    return check


def positive_number(error: type[OffloadError], *, optional: bool = False) -> Validator:
    """A validator accepting finite ints and floats > 0, not bools (and None when `optional`)."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_positive_number(attribute.name, value, error, optional=optional)

    return check


def fraction(error: type[OffloadError]) -> Validator:
    """A validator accepting ints and floats in (0, 1], not bools."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise error(
                f"{attribute.name} must be a fraction in (0, 1], got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def is_bool(error: type[OffloadError]) -> Validator:
    """A validator accepting exactly True or False."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, bool):
            raise error(
                f"{attribute.name} must be True or False, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def non_empty_str(error: type[OffloadError], *, optional: bool = False) -> Validator:
    """A validator accepting non-empty strings (and None when `optional`)."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if not isinstance(value, str) or value == "":
            raise error(
                f"{attribute.name} must be {'None or ' if optional else ''}a non-empty string, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def is_str(error: type[OffloadError]) -> Validator:
    """A validator accepting strings."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, str):
            raise error(
                f"{attribute.name} must be a string, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def tuple_of_ints(minimum: int, error: type[OffloadError]) -> Validator:
    """A validator accepting a tuple of ints, each at least `minimum`."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple) or not all(is_int(v) and v >= minimum for v in value):
            raise error(
                f"{attribute.name} must be a tuple of integers >= {minimum}, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def tuple_of(kind: type, error: type[OffloadError]) -> Validator:
    """A validator accepting a tuple whose members are all instances of `kind`."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple) or not all(isinstance(v, kind) for v in value):
            raise error(
                f"{attribute.name} must be a tuple of {kind.__name__}, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check


def one_of(options: tuple[str, ...], error: type[OffloadError]) -> Validator:
    """A validator accepting one of `options`."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in options:
            raise error(
                f"{attribute.name} must be one of {', '.join(options)}, got {value!r}",
                name=attribute.name,
                value=value,
            )

    return check
