"""Module-level helpers the executors share: finding parameters, patching forwards,
resolving dtypes. No policy lives here; the plan has made every decision."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar
from typing import ParamSpec as _ParamSpec

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError, OffloadError, PlanError
from offload.executors.hoststore import HostStore
from offload.executors.lifecycle import unfinished_restore
from offload.model.describe import describe_tensor
from offload.pure.plan.plan import ParamPlan
from offload.pure.spec.values import ParamSpec

__all__ = [
    "Patched",
    "Ref",
    "current_spec",
    "find_parameter",
    "first_float_tensor",
    "guard_layers",
    "host_of",
    "host_owner",
    "patch_forward",
    "normal_tensors",
    "profiling",
    "raise_as_execution_error",
    "raise_with_progress",
    "refuse_autograd",
    "torch_dtype",
    "unguard_layers",
    "unpatch_forward",
]

#: (layer index, parameter name relative to the layer).
Ref = tuple[int, str]


def find_parameter(layer: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter `name` (dotted, relative to `layer`), or None if it no longer exists."""
    try:
        found: object = layer.get_parameter(name)
    except AttributeError:
        return None
    # A name that now holds a plain tensor (a buffer) is no longer a parameter either.
    return found if isinstance(found, nn.Parameter) else None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (``"bfloat16"``).

    Raises:
        PlanError: torch has no such dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"torch has no dtype named {name!r}", name="dtype", value=name)
    return dtype


#: True while a profiler records (`torch.profiler.profile`): a C call, costing nothing to ask
#: on every forward. The executors then wrap their waits and copies in named ranges.
profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled


def first_float_tensor(values: Sequence[Any]) -> torch.Tensor | None:
    """The first floating-point tensor among `values` (looking one level into tuples and
    lists), else the first tensor, else None: the activation the custom ops order against."""
    first: torch.Tensor | None = None
    for value in values:
        candidates = value if isinstance(value, (tuple, list)) else (value,)
        for item in candidates:
            if isinstance(item, torch.Tensor):
                if item.is_floating_point():
                    return item
                if first is None:
                    first = item
    return first


def patch_forward(module: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], *,
                  method: str = "forward") -> Callable[..., Any] | None:
    """Replace ``module.forward`` (or another `method`) by ``wrap(original)`` on the instance.

    Returns:
        What `unpatch_forward` needs: the instance attribute that was there before, or
        None when the method came from the class.
    """
    previous = module.__dict__.get(method)
    setattr(module, method, wrap(getattr(module, method)))  # instance-level patch, undone by unpatch_forward
    return previous


def unpatch_forward(module: nn.Module, previous: Callable[..., Any] | None, *, method: str = "forward") -> None:
    """Undo `patch_forward`."""
    if previous is None:
        module.__dict__.pop(method, None)
        return
    setattr(module, method, previous)


Patched = list[tuple[nn.Module, Callable[..., Any] | None]]


def guard_layers(layers: Sequence[nn.Module], hooked: Sequence[nn.Module]) -> Patched:
    """Give every layer without a hook of its executor (`hooked`) a forward that refuses
    to run while a restore is unfinished (`unfinished_restore`): its weights may be half
    given back. Each module once, however often it appears in `layers`.

    Returns:
        What `unguard_layers` needs to take the guards off again.
    """
    skip = {id(module) for module in hooked}
    guarded: Patched = []
    for index, layer in enumerate(layers):
        if id(layer) in skip:
            continue
        skip.add(id(layer))

        def refuse(forward: Callable[..., Any], index: int = index) -> Callable[..., Any]:
            def restoring(*args: Any, **kwargs: Any) -> Any:
                raise unfinished_restore(f"layer {index} cannot run")

            return restoring

        guarded.append((layer, patch_forward(layer, refuse)))
    return guarded


def unguard_layers(guarded: Patched) -> None:
    """Undo `guard_layers`."""
    while guarded:
        layer, previous = guarded.pop()
        unpatch_forward(layer, previous)


# ---- moving weights and putting them back (shared by the executors) ----------------------


def host_owner(p: ParamPlan, store: HostStore) -> Ref | None:
    """The (layer, name) whose host copy holds `p`'s data: its own if it has one, else the
    parameter it is tied to (None when neither)."""
    ref = (p.layer, p.name)
    return ref if ref in store else p.tied_to


def host_of(store: HostStore, ref: Ref) -> torch.Tensor:
    """The host copy `ref` owns.

    Raises:
        ExecutionError: `ref` owns none.
    """
    host = store.get(ref)
    if host is None:
        raise ExecutionError(f"no host copy for layer {ref[0]} parameter {ref[1]!r}", name=ref[1], value=ref[0])
    return host


def raise_as_execution_error(exc: BaseException, what: str, name: str) -> NoReturn:
    """Raise `exc` again if it is an `OffloadError` (already clear) or not an `Exception`
    (KeyboardInterrupt); otherwise an `ExecutionError` saying ``what: exc``, from `exc`."""
    if isinstance(exc, OffloadError) or not isinstance(exc, Exception):
        raise exc
    raise ExecutionError(f"{what}: {exc}", name=name, value=type(exc).__name__) from exc


def raise_with_progress(exc: BaseException, what: str, name: str) -> NoReturn:
    """Like `raise_as_execution_error`, but an `OffloadError` is wrapped too (keeping its
    ``name`` and ``value``): for failures part way through a long operation, where
    `what` says how far it got and the cause alone would not."""
    if isinstance(exc, OffloadError):
        raise ExecutionError(f"{what}: {exc}", name=exc.name, value=exc.value) from exc
    raise_as_execution_error(exc, what, name)


def current_spec(p: ParamPlan, tensor: torch.Tensor) -> ParamSpec:
    """What `p`'s parameter is now (its data `tensor`), for `revise_plan`: shape, strides,
    dtype and storage identity of `tensor`, and the device it was planned on."""
    return attrs.evolve(describe_tensor(p.layer, p.name, tensor), device=p.device)


def refuse_autograd(layer: int, module: nn.Module, names: Sequence[str], args: Sequence[Any],
                    kwargs: Mapping[str, Any]) -> None:
    """Refuse a call of offloaded `layer` that would record autograd history through its
    offloaded weights: their storage is a shared slot or a copy made for the call, so a
    backward would compute wrong gradients or none (offload is for inference).

    Args:
        layer: the layer's index, for the message.
        module: the layer.
        names: its offloaded parameters' names.
        args, kwargs: the call's arguments (tensors looked at one level into tuples and lists).

    Raises:
        ExecutionError: grad mode is on and an offloaded weight or an input requires grad.
    """
    if not torch.is_grad_enabled():
        return
    weights = [n for n in names if (p := find_parameter(module, n)) is not None and p.requires_grad]
    inputs = any(
        isinstance(item, torch.Tensor) and item.requires_grad
        for value in (*args, *kwargs.values())
        for item in (value if isinstance(value, (tuple, list)) else (value,))
    )
    if not weights and not inputs:
        return
    why = f"its offloaded weights require grad ({', '.join(weights[:3])}{', ...' if len(weights) > 3 else ''})" \
        if weights else "an input requires grad"
    raise ExecutionError(
        f"offloaded layer {layer} ran with autograd recording ({why}): offload is for inference, and a backward "
        "through offloaded weights would give wrong gradients. Run under torch.inference_mode() or "
        "torch.no_grad(), or call model.requires_grad_(False) and pass inputs that do not require grad",
        name="grad_enabled", value=layer,
    )


_P = _ParamSpec("_P")
_R = TypeVar("_R")


def normal_tensors(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `method` outside inference mode: host copies, buffers and device tensors made
    under ``torch.inference_mode()`` would be inference tensors, which a later forward
    outside that mode cannot use."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with torch.inference_mode(False):
            return method(*args, **kwargs)

    return run
