"""Module-level helpers the executors share: finding parameters, patching forwards,
resolving dtypes. No policy lives here; the plan has made every decision."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.pure.plan import OffloadPlan, ParamPlan

__all__ = [
    "Ref",
    "check_layers",
    "find_parameter",
    "first_float_tensor",
    "patch_forward",
    "torch_dtype",
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


def check_layers(plan: OffloadPlan, layers: Sequence[nn.Module], runtime_device: torch.device) -> dict[Ref, nn.Parameter]:
    """Match every offloaded `ParamPlan` to its live parameter before anything moves.

    Returns:
        The live parameter of each offloaded (layer, name).

    Raises:
        PlanError: the layers are not the ones the plan was made for (count, a missing
            parameter, another shape, stride or dtype) or a parameter is not on the
            runtime's device; the message names the parameter and the difference.
    """
    if len(layers) != plan.num_layers:
        raise PlanError(f"the plan is for {plan.num_layers} layers, got {len(layers)}",
                        name="layers", value=len(layers))
    live: dict[Ref, nn.Parameter] = {}
    for layer_index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PlanError(f"layers[{layer_index}] is a {type(layer).__name__}, not an nn.Module",
                            name=f"layers[{layer_index}]", value=layer)
    for p in plan.offloaded_params:
        live[(p.layer, p.name)] = _match(p, layers[p.layer], runtime_device)
    return live


def _match(p: ParamPlan, layer: nn.Module, device: torch.device) -> nn.Parameter:
    where = f"layer {p.layer} parameter {p.name!r}"
    param = find_parameter(layer, p.name)
    if param is None:
        raise PlanError(f"{where} is in the plan but not in the layer", name=p.name, value=p.layer)
    got = (tuple(param.shape), tuple(param.stride()), str(param.dtype).removeprefix("torch."))
    want = (p.shape, p.stride, p.dtype)
    if got != want:
        raise PlanError(f"{where} is (shape, stride, dtype) {got}, the plan says {want}",
                        name=p.name, value=got)
    if param.device != device:
        raise PlanError(
            f"{where} is on {param.device}, but the runtime's device is {device}"
            + ("; load the weights before wrap_modules" if param.device.type == "meta" else ""),
            name=p.name,
            value=str(param.device),
        )
    return param


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


def patch_forward(module: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any] | None:
    """Replace ``module.forward`` by ``wrap(original)`` on the instance.

    Returns:
        What `unpatch_forward` needs: the instance attribute that was there before, or
        None when ``forward`` came from the class.
    """
    previous = module.__dict__.get("forward")
    module.forward = wrap(module.forward)  # instance-level patch, undone by unpatch_forward
    return previous


def unpatch_forward(module: nn.Module, previous: Callable[..., Any] | None) -> None:
    """Undo `patch_forward`."""
    if previous is None:
        if "forward" in module.__dict__:
            del module.forward
        return
    module.forward = previous


def release_error(what: str, exc: BaseException) -> ExecutionError:
    """An `ExecutionError` for a failed effect, naming what was being done."""
    return ExecutionError(f"{what} failed: {exc}", name=what, value=type(exc).__name__)
