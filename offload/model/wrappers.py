"""Weights that are wrapper tensor subclasses (torchao's quantised ``Int8Tensor`` and
``Float8Tensor``, anything with ``__tensor_flatten__`` / ``__tensor_unflatten__``): their
bytes live in plain inner tensors (int8 values, scales, zero points), and the wrapper
computes with them in every op.

Such a weight is offloaded by its inner tensors. While a model is offloaded, each one is
a parametrisation of its module (``torch.nn.utils.parametrize``): the inner tensors are
plain Parameters named ``<module>.parametrizations.<leaf>.original<i>`` (``i`` in the
order ``__tensor_flatten__`` lists them), which the executors move, prefetch and view as
they do every other parameter, and the module's ``<leaf>`` is the wrapper rebuilt over
them (``__tensor_unflatten__``) each time the module reads it: over the slots under
prefetch, over the views or the copies made for the call under UVA and on demand
(`offload.executors.placement.unpack` does it, and undoes it at `restore`).

`describe_layers` describes such a layer as it will be once unpacked: the same names in
the same order as ``named_parameters()`` then gives them (`expand_wrappers`), so that a
plan made before wrapping matches the layers after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from offload.errors import PlanError

__all__ = ["PARAMETRIZATIONS", "expand_wrappers", "inner_names", "inner_tensors", "is_wrapper", "unpacked_name"]

#: Where ``torch.nn.utils.parametrize`` keeps a module's parametrisations.
PARAMETRIZATIONS = "parametrizations"

#: (name, tensor) pairs of one layer in ``named_parameters(remove_duplicate=False)``
#: order, names relative to the layer, None tensors included (as ``_parameters`` holds them).
Pairs = Sequence[tuple[str, torch.Tensor | None]]


def _unpacks(tensor: torch.Tensor | None) -> bool:
    """Whether `tensor` is a wrapper `expand_wrappers` expands (plain Parameters and tensors,
    the most of them, told apart by type first)."""
    return tensor is not None and type(tensor) is not nn.Parameter and type(tensor) is not torch.Tensor \
        and is_wrapper(tensor)


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a wrapper subclass: its data live in inner tensors
    (``__tensor_flatten__``), not in a storage of its own (a plain Python subclass of
    Parameter keeps its storage and is offloaded as any other)."""
    return callable(getattr(type(tensor), "__tensor_flatten__", None))


def _type_name(tensor: torch.Tensor) -> str:
    cls = type(tensor)
    return f"{cls.__module__}.{cls.__qualname__}"


def inner_names(layer_index: int, name: str, tensor: torch.Tensor) -> tuple[str, ...]:
    """The names of `tensor`'s inner tensors, in ``__tensor_flatten__`` order.

    Args:
        layer_index, name: where `tensor` is, for errors.
        tensor: a wrapper (`is_wrapper`).

    Raises:
        PlanError: the wrapper cannot be offloaded by its inner tensors: it cannot say what
            they are (``__tensor_flatten__`` fails, or it has no ``__tensor_unflatten__``),
            it has none, or one is not a plain dense tensor (a wrapper inside a wrapper,
            a sparse tensor); named by parameter and type, before anything moves.
    """
    kind = _type_name(tensor)

    def refuse(why: str) -> PlanError:
        return PlanError(
            f"layer {layer_index}: parameter {name!r} is a {kind} (a tensor subclass) that cannot be offloaded by "
            f"its inner tensors: {why}; keep the layers holding such weights out of the stack given to offload",
            name=name, value=kind)

    if not callable(getattr(type(tensor), "__tensor_unflatten__", None)):
        raise refuse("it has no __tensor_unflatten__ to rebuild it from them")
    try:
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass's protocol
    except Exception as exc:  # a subclass that cannot say: refused, with its reason
        raise refuse(f"__tensor_flatten__ failed ({type(exc).__name__}: {exc})") from exc
    found = tuple(str(inner) for inner in names)
    if not found:
        raise refuse("__tensor_flatten__ lists no inner tensor")
    for inner in found:
        value = getattr(tensor, inner, None)
        if not isinstance(value, torch.Tensor):
            raise refuse(f"its inner {inner!r} is a {type(value).__name__}, not a tensor")
        if is_wrapper(value) or value.layout is not torch.strided:
            raise refuse(f"its inner {inner!r} is a {_type_name(value)} with layout {value.layout}, not a plain "
                         "dense tensor")
    return found


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The inner tensors of a wrapper (`is_wrapper`), in ``__tensor_flatten__`` order;
    ``[tensor]`` for a plain one. For reading what a tensor holds (its bytes, its storage
    identity) where it is not offloaded, so never refused: a wrapper that cannot say is
    described by itself."""
    if not is_wrapper(tensor):
        return [tensor]
    try:
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass's protocol
    except Exception:  # it cannot say: itself
        return [tensor]
    found = [getattr(tensor, str(name), None) for name in names]
    return [inner for inner in found if isinstance(inner, torch.Tensor)] or [tensor]


def unpacked_name(prefix: str, leaf: str, index: int) -> str:
    """The name of inner tensor `index` of the wrapper `leaf` of the module at `prefix`
    (``""``: the layer itself) once unpacked: ``<prefix>.parametrizations.<leaf>.original<index>``."""
    dot = f"{prefix}." if prefix else ""
    return f"{dot}{PARAMETRIZATIONS}.{leaf}.original{index}"


def expand_wrappers(layer_index: int, pairs: Pairs) -> list[tuple[str, torch.Tensor | None]]:
    """`pairs` with each wrapper replaced by its inner tensors, named and placed as
    ``named_parameters(remove_duplicate=False)`` lists them once the layer is unpacked.

    Registering a parametrisation takes the weight out of its module's ``_parameters``
    and appends a ``parametrizations`` submodule to the module's children, holding one
    list per weight (in the order they are registered, which is the order of
    ``_parameters``) whose own parameters are ``original0``, ``original1``, ...: so a
    module's inner tensors come after all of its own parameters and its submodules', its
    children's before its own.

    Args:
        layer_index: for errors.
        pairs: the layer's pairs, in ``named_parameters`` order.

    Raises:
        PlanError: as `inner_names`; or a wrapper's module is already parametrised (its
            names would then not be the ones described).
    """
    expansions: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in pairs:
        if tensor is None or not _unpacks(tensor):
            continue
        prefix, _, leaf = name.rpartition(".")
        names = inner_names(layer_index, name, tensor)
        inner = expansions.setdefault(prefix, [])
        inner.extend((unpacked_name(prefix, leaf, i), getattr(tensor, n)) for i, n in enumerate(names))
    if not expansions:
        return list(pairs)
    for prefix in expansions:
        taken = f"{prefix}.{PARAMETRIZATIONS}." if prefix else f"{PARAMETRIZATIONS}."
        clash = next((name for name, _ in pairs if name.startswith(taken)), None)
        if clash is not None:
            raise PlanError(
                f"layer {layer_index}: module {prefix or '(the layer)'!r} holds a quantised weight and is already "
                f"parametrised ({clash!r}); offload cannot unpack a weight beside a parametrisation of its own",
                name=clash, value=prefix)
    # Where each module's subtree ends: the last pair named inside it (the pairs of a
    # module and its submodules are consecutive, as named_modules walks depth first).
    ends: dict[int, list[str]] = {}
    for prefix in expansions:
        dot = f"{prefix}." if prefix else ""
        last = max(i for i, (name, _) in enumerate(pairs) if name.startswith(dot))
        ends.setdefault(last, []).append(prefix)
    out: list[tuple[str, torch.Tensor | None]] = []
    for i, (name, tensor) in enumerate(pairs):
        prefix = name.rpartition(".")[0]
        if not (prefix in expansions and _unpacks(tensor)):
            out.append((name, tensor))
        # Deeper modules first: a child's parametrisations lie among its parent's children.
        for ending in sorted(ends.get(i, ()), key=lambda p: (-p.count(".") if p else 1, p)):
            out.extend(expansions[ending])
    return out
