"""The mark an offloader leaves on the layers it wraps, until it restores them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from torch import nn

from offload.errors import ExecutionError

_MARK = "_offload_mark"


@final
class OffloadMark:
    """Set on every layer an offloader has wrapped, until it restores them: a second
    wrap of those layers, by any offloader, is refused by name; so are ``copy.deepcopy``
    and pickling of the model (the copy would point at this offloader's slots and views
    and drive its hooks)."""

    __slots__ = ("owner",)

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __deepcopy__(self, memo: object) -> OffloadMark:
        raise ExecutionError(
            f"cannot deepcopy an offloaded model (its layers are wrapped by {self.owner}): the copy would share "
            "its offloader's slots and hooks; deepcopy before offloading, or call restore() first",
            name="deepcopy", value=self.owner)

    def __reduce__(self) -> Any:
        raise ExecutionError(
            f"cannot pickle an offloaded model (its layers are wrapped by {self.owner}): save its state_dict(), "
            "which holds the real weights, or call restore() first", name="pickle", value=self.owner)

    def __repr__(self) -> str:
        return f"OffloadMark({self.owner})"


def claim(layers: Sequence[nn.Module], owner: object) -> None:
    """Refuse layers another offloader has wrapped and not restored (before anything moves).

    Raises:
        ExecutionError: naming the layer and the offloader holding it.
    """
    for index, layer in enumerate(layers):
        mark = getattr(layer, "__dict__", {}).get(_MARK)
        if isinstance(mark, OffloadMark):
            raise ExecutionError(
                f"layers[{index}] ({type(layer).__name__}) is already offloaded by {mark.owner}; restore() that "
                "offloader first (a second one would copy its shared slots: another layer's weights)",
                name=f"layers[{index}]", value=mark.owner)


def mark(layers: Sequence[nn.Module], owner: object) -> None:
    """Mark `layers` as wrapped by `owner` (see `OffloadMark`)."""
    tag = OffloadMark(f"{type(owner).__name__}@{id(owner):#x}")
    for layer in layers:
        # First in the instance dict, so that pickling meets the mark before the hooks
        # (local functions, which pickle would refuse with a less helpful error).
        rest = {k: v for k, v in layer.__dict__.items() if k != _MARK}
        layer.__dict__.clear()
        layer.__dict__[_MARK] = tag
        layer.__dict__.update(rest)


def unmark(layers: Sequence[nn.Module]) -> None:
    """Take the marks off again (restore)."""
    for layer in layers:
        layer.__dict__.pop(_MARK, None)
