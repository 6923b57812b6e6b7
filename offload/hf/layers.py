"""`find_stacks` and `find_layers`: the repeated block stacks of a model, found by their
structure.

A layer stack is a `nn.ModuleList` of two or more blocks of one class, each holding
parameters (``model.model.layers``, ``transformer.h``, ``encoder.layer``,
``decoder.block``), not nested inside another such stack (MoE experts inside a layer are
part of the layer). No table of attribute names is consulted, so new architectures work
without a change here. A model may have several (an encoder and a decoder, a vision tower
and a language model, Flux's double and single blocks): `find_stacks` returns every one,
in module order, which is the order they run in for the models we know of (an encoder
is registered before its decoder, a vision tower before its language model);
`find_layers` returns one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeGuard

from torch import nn

from offload.errors import PlanError
from offload.pure.units import format_bytes

__all__ = ["StackCandidate", "find_layers", "find_stacks", "layer_stacks"]

#: A stack is chosen when it holds more than this share of the parameter bytes of all
#: candidate stacks (the decoder of an encoder-decoder model holds the cross-attention too).
MAJORITY = 0.5


class StackCandidate(NamedTuple):
    """A repeated block stack: its dotted path in the model, the list, and its bytes."""

    path: str
    layers: nn.ModuleList
    nbytes: int


def _unique_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for param in module.parameters():
        key = id(param)
        if key not in seen:
            seen.add(key)
            total += param.numel() * param.element_size()
    return total


def _is_stack(module: nn.Module) -> TypeGuard[nn.ModuleList]:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return False
    kinds = {type(child) for child in module}
    return len(kinds) == 1 and all(any(True for _ in child.parameters()) for child in module)


def layer_stacks(model: nn.Module) -> list[StackCandidate]:
    """Every outermost repeated block stack of `model`, in module order."""
    found: list[StackCandidate] = []
    for path, module in model.named_modules(remove_duplicate=True):
        if any(path == c.path or path.startswith(c.path + ".") for c in found):
            continue  # inside a stack already found: part of its layers
        if _is_stack(module):
            found.append(StackCandidate(path=path, layers=module, nbytes=_unique_bytes(module)))
    return found


def find_layers(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """The model's layer stack: the unit `offload` plans and offloads layer by layer.

    Args:
        model: any `nn.Module`, typically a `transformers` model.
        path: the dotted path of the stack (``"model.layers"``), to choose one explicitly.

    Returns:
        The stack found: the only one, or the one holding most of the candidates'
        parameter bytes (more than half: the decoder of an encoder-decoder model).

    Raises:
        PlanError: no stack, several stacks none of which holds most of the bytes (the
            message names every candidate with its size; pass `path`), or `path` names
            no stack of two or more blocks.
    """
    if path is not None:
        try:
            module = model.get_submodule(path)
        except AttributeError as exc:
            raise PlanError(f"the model has no module {path!r}", name="path", value=path) from exc
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            raise PlanError(f"{path!r} is a {type(module).__name__}, not a non-empty nn.ModuleList of layers",
                            name="path", value=path)
        return module
    stacks = layer_stacks(model)
    if not stacks:
        raise PlanError(
            f"no layer stack found in {type(model).__name__}: no nn.ModuleList of two or more blocks of one "
            "class holding parameters; pass path= to name one",
            name="layers", value=type(model).__name__,
        )
    if len(stacks) == 1:
        return stacks[0].layers
    total = sum(c.nbytes for c in stacks)
    best = max(stacks, key=lambda c: c.nbytes)
    if best.nbytes > MAJORITY * total:
        return best.layers
    names = ", ".join(f"{c.path} ({len(c.layers)} x {type(c.layers[0]).__name__}, {format_bytes(c.nbytes)})"
                      for c in stacks)
    raise PlanError(f"several layer stacks and none holds most of the weights: {names}; pass path= to choose",
                    name="layers", value=tuple(c.path for c in stacks))


def find_stacks(model: nn.Module, paths: str | Sequence[str] | None = None) -> list[nn.ModuleList]:
    """Every layer stack of the model, each planned as a cycle of its own
    (`offload.describe_stacks`), in the order they run.

    Args:
        model: any `nn.Module`, typically a `transformers` or `diffusers` model.
        paths: the dotted paths of the stacks to offload (``"model.encoder.layers"``, or
            several, in the order they run); None: every stack found by structure
            (`layer_stacks`), in module order.

    Returns:
        The stacks.

    Raises:
        PlanError: no stack; a path that names no non-empty `nn.ModuleList`; a stack inside
            another, or a layer in two stacks.
    """
    if paths is None:
        stacks = [c.layers for c in layer_stacks(model)]
        if not stacks:
            raise PlanError(
                f"no layer stack found in {type(model).__name__}: no nn.ModuleList of two or more blocks of one "
                "class holding parameters; pass layers_path= to name one",
                name="layers", value=type(model).__name__,
            )
        return stacks
    names = [paths] if isinstance(paths, str) else list(paths)
    if not names:
        raise PlanError("layers_path names no stack", name="path", value=tuple(names))
    stacks = [find_layers(model, name) for name in names]
    seen: dict[int, str] = {}
    for name, stack in zip(names, stacks, strict=True):
        for module in stack.modules():
            other = seen.setdefault(id(module), name)
            if other != name:
                raise PlanError(f"{name!r} and {other!r} overlap: each layer belongs to one stack", name="path",
                                value=(other, name))
    return stacks
