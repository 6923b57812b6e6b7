"""Module-level helpers the executors share: finding parameters, patching forwards,
resolving dtypes. No policy lives here; the plan has made every decision."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import torch
from torch import nn

from offload.describe import describe_tensor
from offload.errors import ExecutionError, OffloadError, PlanError
from offload.executors.hoststore import HostStore
from offload.protocols import Runtime
from offload.pure.plan import OffloadPlan, ParamPlan
from offload.pure.spec import ParamSpec

__all__ = [
    "Lifecycle",
    "Ref",
    "check_layers",
    "copy_back",
    "current_spec",
    "find_parameter",
    "first_float_tensor",
    "host_of",
    "host_owner",
    "patch_forward",
    "raise_as_execution_error",
    "roll_back",
    "torch_dtype",
    "unpatch_forward",
]

class Lifecycle(enum.Enum):
    """Where an executor is: made, wrapped (weights in host memory), ready (post_init
    done), or restored (done for good)."""

    NEW = "new"
    WRAPPED = "wrapped"
    READY = "ready"
    RESTORED = "restored"


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


def roll_back(moved: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Point each parameter back at the data it held before it was moved, last move first
    (so a Parameter moved under two tied names ends at the data it had first)."""
    for param, data in reversed(moved):
        param.data = data


def raise_as_execution_error(exc: BaseException, what: str, name: str) -> NoReturn:
    """Raise `exc` again if it is an `OffloadError` (already clear) or not an `Exception`
    (KeyboardInterrupt); otherwise an `ExecutionError` saying ``what: exc``, from `exc`."""
    if isinstance(exc, OffloadError) or not isinstance(exc, Exception):
        raise exc
    raise ExecutionError(f"{what}: {exc}", name=name, value=type(exc).__name__) from exc


def current_spec(p: ParamPlan, tensor: torch.Tensor) -> ParamSpec:
    """What `p`'s parameter is now (its data `tensor`), for `revise_plan`: shape, strides,
    dtype and storage identity of `tensor`, and the device it was planned on."""
    return attrs.evolve(describe_tensor(p.layer, p.name, tensor), device=p.device)


def copy_back(
    plan: OffloadPlan,
    layers: Sequence[nn.Module],
    store: HostStore,
    origin: Mapping[Ref, torch.device],
    runtime: Runtime,
) -> tuple[list[tuple[nn.Parameter, torch.Tensor]], int]:
    """Copy every offloaded parameter's host copy back to the device it came from.

    Nothing is assigned here: the caller points each parameter at its tensor once every
    copy succeeded, so a failed copy leaves the model as it was. Parameters that share a
    host copy get one tensor, so ties survive; deleted parameters are skipped.

    Returns:
        (parameter, its restored data) for every live offloaded parameter, and how many
        storages were copied.

    Raises:
        ExecutionError: a parameter has no host copy; a copy failed (from the runtime).
    """
    restored: dict[Ref, torch.Tensor] = {}
    moves: list[tuple[nn.Parameter, torch.Tensor]] = []
    for p in plan.offloaded_params:
        param = find_parameter(layers[p.layer], p.name)
        if param is None:
            continue
        owner = host_owner(p, store)
        if owner is None or owner not in store:
            raise ExecutionError(f"no host copy for layer {p.layer} parameter {p.name!r}",
                                 name=p.name, value=p.layer)
        data = restored.get(owner)
        if data is None:
            data = restored[owner] = runtime.copy_to(host_of(store, owner), origin[owner])
        moves.append((param, data))
    return moves, len(restored)
