"""Quantised weights unpacked into their inner tensors while a model is offloaded, and
packed again at restore (`offload.model.wrappers` says what and why).

`unpack` registers, on each module holding a wrapper subclass weight, a parametrisation
(``torch.nn.utils.parametrize``) whose originals are the wrapper's inner tensors, as plain
Parameters the executors handle as any other, and whose value is the wrapper rebuilt
over them on each read. The wrapper object itself is kept for `Unpacked.pack`, its inner
tensors pointed at the originals: it holds no memory of its own while they move (a
wrapper that kept its inner tensors would keep the device copy alive), and it is the same
object its module holds again after restore (ties between modules kept, references users
hold still valid).

While unpacked:

- ``state_dict()`` gives each weight under its own name, rebuilt over its inner tensors'
  real values (`Unpacked.hooks`, run after the executor's hook that puts in the host
  copies), as the resident model gives it;
- a conversion (``model.to(dtype)``, ``.cuda()``) is the wrapper's, as on the resident
  model, never its inner tensors' one by one (an int8 weight's scale cast without the
  wrapper knowing): one that leaves the wrapper as it is (torchao's keep their dtypes
  through ``.to(dtype)``) leaves them as they are; one that would change it is refused.
  Modules the conversion reached before the refusal are converted, as torch leaves them
  when any ``_apply`` fails part way;
- ``load_state_dict`` and ``load_weights`` name the inner tensors, not the weight: a
  state dict of the resident model does not load (its keys are missing); restore first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, final

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from offload.errors import ExecutionError, PlanError
from offload.executors.conversions import same_memory
from offload.logs import logger
from offload.model.wrappers import PARAMETRIZATIONS, inner_names, inner_tensors, is_wrapper

__all__ = ["Unpacked", "has_wrappers", "unpack"]

log = logger("offload.load")


@final
class _Rebuild(nn.Module):
    """The parametrisation of one wrapper weight: its inner tensors in, the wrapper out."""

    def __init__(self, cls: type[torch.Tensor], names: tuple[str, ...], ctx: Any, size: torch.Size,
                 stride: tuple[int, ...]) -> None:
        super().__init__()
        self.cls, self.names, self.ctx, self.size, self.stride_ = cls, names, ctx, size, stride

    def forward(self, *inner: torch.Tensor) -> torch.Tensor:
        rebuilt: torch.Tensor = self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]  # the subclass protocol
            dict(zip(self.names, inner, strict=True)), self.ctx, self.size, self.stride_)
        return rebuilt

    def right_inverse(self, wrapper: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(wrapper, name) for name in self.names)


#: One unpacked weight: (its module, its name there, the wrapper Parameter, its inner names).
_Entry = tuple[nn.Module, str, torch.Tensor, tuple[str, ...]]


def _wrappers(layer: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(module name in the layer, module, leaf, wrapper) for each wrapper weight of
    `layer`, each module once (none for what is not a module: `move_all` refuses it by name)."""
    found: list[tuple[str, nn.Module, str, torch.Tensor]] = []
    given: object = layer  # callers without a type checker pass anything
    if not isinstance(given, nn.Module):
        return found
    for prefix, module in layer.named_modules():
        for leaf, tensor in module._parameters.items():
            if tensor is not None and is_wrapper(tensor):
                found.append((prefix, module, leaf, tensor))
    return found


def has_wrappers(layers: Sequence[nn.Module]) -> bool:
    """Whether any of `layers` holds a wrapper subclass weight (a quantised one)."""
    return any(_wrappers(layer) for layer in layers)


@final
class Unpacked:
    """The wrapper weights `unpack` unpacked, to pack them again (`pack`)."""

    def __init__(self, entries: list[_Entry], orders: dict[int, tuple[nn.Module, tuple[str, ...]]]) -> None:
        self._entries = entries
        self._orders = orders  # id(module) -> (module, its _parameters' keys before)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def pack(self) -> None:
        """Put every wrapper back on its module, over its inner tensors' data as they are
        now (after restore: bit for bit what they were, on their devices), with each
        module's class and its parameters' order as they were. Idempotent, and a retry
        after a failure finishes the rest (an entry is forgotten once packed)."""
        while self._entries:
            module, leaf, wrapper, names = self._entries[-1]
            originals = getattr(module, PARAMETRIZATIONS)[leaf]
            for index, name in enumerate(names):
                setattr(wrapper, name, getattr(originals, f"original{index}").data)
            with torch.no_grad():
                parametrize.remove_parametrizations(module, leaf, leave_parametrized=True)
            module._buffers.pop(leaf, None)
            module._parameters.pop(leaf, None)
            module._parameters[leaf] = wrapper  # type: ignore[assignment]  # a Parameter that is a wrapper
            self._entries.pop()
        for module, order in self._orders.values():
            params = module._parameters
            held = {key: params.pop(key) for key in list(params)}
            for key in (*order, *held):
                if key in held:
                    params[key] = held.pop(key)
        self._orders = {}

    def hooks(self, layers: Sequence[nn.Module], indices: Sequence[int]) -> list[RemovableHandle]:
        """``state_dict`` post hooks for `layers` at `indices` (register them after the
        executor's own, which put the host copies in): each unpacked weight's inner
        entries become the weight, rebuilt over them, under its own name."""
        leaves: dict[int, list[str]] = {}
        for module, leaf, _, _ in self._entries:
            leaves.setdefault(id(module), []).append(leaf)
        by_layer: dict[int, list[tuple[str, str, nn.Module]]] = {}
        for index in indices if leaves else ():
            for prefix, module in layers[index].named_modules(remove_duplicate=False):
                for leaf in leaves.get(id(module), ()):
                    by_layer.setdefault(index, []).append((prefix, leaf, module))
        handles = []
        for index, entries in by_layer.items():
            handles.append(layers[index].register_state_dict_post_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
                _packing_hook(entries)))
        return handles


def _packing_hook(entries: list[tuple[str, str, nn.Module]]) -> Callable[..., None]:
    def hook(layer: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for where, leaf, module in entries:
            dot = f"{prefix}{where}." if where else prefix
            rebuild = getattr(module, PARAMETRIZATIONS)[leaf][0]
            keys = [f"{dot}{PARAMETRIZATIONS}.{leaf}.original{i}" for i in range(len(rebuild.names))]
            if not all(key in state_dict for key in keys):
                continue
            inner = [state_dict.pop(key) for key in keys]
            state_dict[f"{dot}{leaf}"] = rebuild(*inner)
        # The order of a resident model's keys is not kept: a state dict is a mapping.

    return hook


def _wrapper_apply(original: Callable[..., Any], module: nn.Module, weight: str) -> Callable[..., Any]:
    """An instance ``_apply`` for the parametrisation list of an unpacked weight: a
    conversion goes to the wrapper, as on the resident model (torchao's wrappers keep
    their inner dtypes through ``.to(dtype)``). One that leaves the wrapper as it is
    leaves the inner tensors as they are (not converted apart from it); one that would
    change it is refused (see the module docstring)."""

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        wrapper = module()
        converted = fn(wrapper)
        if converted is wrapper or (type(converted) is type(wrapper) and all(
                same_memory(a, b) for a, b in zip(inner_tensors(converted), inner_tensors(wrapper), strict=True))):
            return module
        raise ExecutionError(
            f"cannot convert the quantised weight {weight!r} while it is offloaded (the conversion changes its "
            "inner tensors, which are the offloader's); call restore(), convert, and offload again. Modules "
            "converted before this one stay converted", name=weight, value=type(wrapper).__qualname__)

    return apply


def unpack(layers: Sequence[nn.Module]) -> Unpacked:
    """Unpack every wrapper weight of `layers` into its inner tensors (see the module
    docstring); a layer without one is left as it is. If anything fails, what was
    unpacked is packed again before the error is raised.

    Raises:
        PlanError: a wrapper that cannot be unpacked (`inner_names`, or torch refuses
            the parametrisation: inner tensors that cannot be Parameters as it requires).
    """
    unpacked = Unpacked([], {})
    try:
        for index, layer in enumerate(layers):
            # A module in two layers is unpacked in the first: the second finds no wrapper.
            for prefix, module, leaf, wrapper in _wrappers(layer):
                name = f"{prefix}.{leaf}" if prefix else leaf
                names = inner_names(index, name, wrapper)
                _, ctx = wrapper.__tensor_flatten__()  # type: ignore[attr-defined]  # the subclass protocol
                unpacked._orders.setdefault(id(module), (module, tuple(module._parameters)))
                rebuild = _Rebuild(type(wrapper), names, ctx, wrapper.size(), wrapper.stride())
                try:
                    parametrize.register_parametrization(module, leaf, rebuild, unsafe=True)
                except Exception as exc:
                    raise PlanError(f"layer {index}: the quantised weight {name!r} ({type(wrapper).__qualname__}) "
                                    f"could not be unpacked into its inner tensors {list(names)}: "
                                    f"{type(exc).__name__}: {exc}", name=name, value=type(wrapper).__qualname__) from exc
                unpacked._entries.append((module, leaf, wrapper, names))
                originals = getattr(module, PARAMETRIZATIONS)[leaf]
                for i, inner in enumerate(names):
                    setattr(wrapper, inner, getattr(originals, f"original{i}"))
                originals._apply = _wrapper_apply(originals._apply, originals, name)  # instance patch, gone with the list
    except BaseException:
        unpacked.pack()
        raise
    if unpacked:
        log.info("unpacked %d quantised weights into their inner tensors", len(unpacked))
    return unpacked
