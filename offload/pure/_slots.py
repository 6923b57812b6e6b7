"""Filling the slots of a frozen attrs instance directly: the trusted construction path.

A value built by its class runs every validator, which is what protects values that come
from users (built by hand, read from JSON). Values the code derives itself, from parts
that are already validated or that torch guarantees, are built in bulk (tens of thousands
of parameters per model, with a time budget), so each class whose values are built that
way has a trusted builder beside it that creates the instance and sets its slots, with
the same values the class would hold. This is construction, not mutation: nothing is
ever set on an instance after it has been handed out (DESIGN.md: change with
``attrs.evolve``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Setter", "slot_setters"]

#: Sets one slot of an instance, bypassing the frozen ``__setattr__``.
Setter = Callable[[Any, Any], None]


def slot_setters(cls: type, fields: tuple[str, ...], derived: tuple[str, ...] = ()) -> tuple[Setter, ...]:
    """The slot setters of `cls` for `fields` then `derived`, in that order.

    Args:
        cls: a slotted attrs class.
        fields: every attrs field of `cls`, in definition order: a builder that sets
            fewer would hand out an instance missing one, so anything else is refused.
        derived: cached properties the builder fills too (their slots, which attrs adds).

    Raises:
        TypeError: `fields` is not exactly the fields of `cls`, or a name has no slot
            (a programming error, found when the module defining the builder is imported).
    """
    declared = tuple(f.name for f in attrs.fields(cls))
    if fields != declared:
        raise TypeError(f"a trusted builder of {cls.__name__} sets {fields}, but its fields are {declared}")
    setters: list[Setter] = []
    for name in (*fields, *derived):
        slot = cls.__dict__.get(name)
        setter = getattr(slot, "__set__", None)
        if setter is None or type(slot).__name__ != "member_descriptor":
            raise TypeError(f"{cls.__name__}.{name} is not a slot")
        setters.append(setter)
    return tuple(setters)
