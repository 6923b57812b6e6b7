"""Conversions of a prefetched model (``model.to(dtype)``, ``.half()``, ``.cuda()``): each
goes through ``nn.Module._apply(fn)``, which calls ``fn`` on every parameter. A prefetched
parameter points at a static slot that holds whichever layer last ran there, so ``fn``
of it would convert another layer's weights. The prefetch executor gives each module
holding an offloaded parameter an instance ``_apply`` (`converting_apply`) whose ``fn``
converts the parameter's host copy instead; a conversion that changes nothing
(`same_memory`) leaves the parameter on its slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import torch
from torch import nn

__all__ = ["Convert", "converting_apply", "same_memory"]

#: ``nn.Module._apply``'s ``fn``: a tensor in, its conversion out.
Fn = Callable[[torch.Tensor], torch.Tensor]

#: What the executor does for one parameter: (the Parameter, ``fn``) -> its conversion.
Convert = Callable[[nn.Parameter, Fn], torch.Tensor]


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b`'s memory seen the same way (a conversion that changed nothing)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride())


def converting_apply(original: Callable[..., Any], convert: Convert) -> Callable[..., Any]:
    """An instance ``_apply`` for a module: `original` (its ``_apply``), with ``fn``
    wrapped so that parameters go through `convert` (once, however deep the modules
    holding offloaded parameters are nested)."""

    def offloaded_apply(fn: Fn, *args: Any, **kwargs: Any) -> Any:
        return original(fn if isinstance(fn, _Converting) else _Converting(fn, convert), *args, **kwargs)

    return offloaded_apply


@final
class _Converting:
    """``fn`` with parameters handed to `convert`; other tensors (buffers, gradients) pass
    through."""

    __slots__ = ("convert", "fn")

    def __init__(self, fn: Fn, convert: Convert) -> None:
        self.fn = fn
        self.convert = convert

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter):
            return self.convert(tensor, self.fn)
        return self.fn(tensor)
