"""On-demand loading: a layer's forward run with device copies of its host-resident
weights, through `torch.func.functional_call` (``tie_weights=False``: tied names are given
the same device tensor explicitly). Module-level functions; the UVA executor holds the state.

The copies are queued on the compute stream by `Runtime.to_device`, ahead of the kernels
that read them, and freed by the allocator when the call returns. Nothing is prefetched:
this path is as slow as the link (the plan warns), and from pageable memory it cannot be
captured in a CUDA graph.

What each layer copies is fixed at `post_init` (`LayerCopies`). Under torch.compile the
copies are made by the custom op `offload.executors.ops.copy_on_demand`, which calls the
same `copy_layer`; in eager the executor calls it directly.

Exact routes. In eager, the copies swapped in for a call require grad exactly when the
Parameters they stand for do (`grads_wanted`), and those that do are ordinary tensors even
under ``torch.inference_mode`` (an inference tensor that requires grad takes other routes
than a Parameter). PyTorch's dispatch reads the flag even without autograd: ``F.linear``
on an input whose leading dimensions cannot be flattened without a copy folds into one
``mm`` for a weight that requires grad and runs a batched one otherwise, which rounds
differently. So an on-demand layer computes exactly what its resident original does.
Such a copy (float32, a leaf that requires grad) is what autocast caches its casts of until
the outermost autocast region ends, which would keep every call's copies alive: the layer
runs with autocast's cache off (`run_swapped`), which recomputes the same casts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref, host_of, host_owner, raise_as_execution_error
from offload.executors.hoststore import HostStore
from offload.protocols import Runtime
from offload.pure.decide.pinning import PinDecision
from offload.pure.plan.plan import ParamPlan

__all__ = [
    "Entries",
    "LayerCall",
    "LayerCopies",
    "Site",
    "bind_sites",
    "check_capturable",
    "copy_layer",
    "grads_wanted",
    "holder_now",
    "on_demand_layers",
    "run_swapped",
    "run_with",
]

#: Per layer: (parameter name within the layer, owner of its host copy), for every
#: parameter the layer copies per call.
Entries = tuple[tuple[str, Ref], ...]


@attrs.frozen
class LayerCopies:
    """What one on-demand layer copies per call, fixed at `post_init`.

    Attributes:
        entries: (parameter name, owner of its host copy), per copied parameter.
        owners: the distinct owners, in copy order (a tied storage is copied once).
        keys: (`functional_call` key, index into `owners`), per copied parameter.
        names: the copied parameters' names within the layer.
    """

    entries: Entries
    owners: tuple[Ref, ...]
    keys: tuple[tuple[str, int], ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, entries: Entries) -> LayerCopies:
        """The copies for these entries."""
        owners = tuple(dict.fromkeys(owner for _, owner in entries))
        index = {owner: i for i, owner in enumerate(owners)}
        keys = tuple((f"layer.{name}", index[owner]) for name, owner in entries)
        return cls(entries, owners, keys, tuple(name for name, _ in entries))


class LayerCall(nn.Module):
    """A layer's own forward as a module `functional_call` can reparametrize: the layer is
    its child ``layer``. Calling the forward rather than the layer keeps the layer's hooks
    to the one run the caller's ``layer(...)`` makes."""

    def __init__(self, layer: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.layer = layer
        self.run = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward, with whatever `functional_call` swapped in."""
        return self.run(*args, **kwargs)


def on_demand_layers(params: Iterable[ParamPlan], store: HostStore, viewed: set[Ref]) -> dict[int, LayerCopies]:
    """Which parameters each layer copies per call: those whose host copy has no device view
    (placed ON_DEMAND, or UVA whose pinning fell back)."""
    table: dict[int, list[tuple[str, Ref]]] = {}
    for p in params:
        owner = host_owner(p, store)
        if owner is not None and owner not in viewed:
            table.setdefault(p.layer, []).append((p.name, owner))
    return {layer: LayerCopies.of(tuple(entries)) for layer, entries in table.items()}


def copy_layer(copies: LayerCopies, store: HostStore, runtime: Runtime,
               grads: Sequence[bool] | None = None) -> tuple[list[torch.Tensor], int]:
    """A device copy of each of the layer's host copies, once per storage.

    Args:
        copies: what the layer copies.
        store: the host copies.
        runtime: makes the device copies.
        grads: per owner (`copies.owners` order), whether its copy is to require grad as
            its Parameter does (`grads_wanted`; see "Exact routes" above); None: none does.

    Returns:
        The copies (in `copies.owners` order) and the bytes they moved.

    Raises:
        ExecutionError: a copy failed (the cause attached).
    """
    if grads is not None and torch.is_inference_mode_enabled():
        with torch.inference_mode(False):  # ordinary tensors, as the Parameters are
            return _copy_layer(copies, store, runtime, grads)
    return _copy_layer(copies, store, runtime, grads)


def _copy_layer(copies: LayerCopies, store: HostStore, runtime: Runtime,
                grads: Sequence[bool] | None) -> tuple[list[torch.Tensor], int]:
    out: list[torch.Tensor] = []
    nbytes = 0
    for i, owner in enumerate(copies.owners):
        host = host_of(store, owner)
        try:
            copy = runtime.to_device(host)
        except BaseException as exc:
            raise_as_execution_error(exc, f"the on-demand copy of layer {owner[0]} parameter {owner[1]!r} failed",
                                     owner[1])
        if grads is not None and grads[i] and copy is not host:
            copy.requires_grad_(True)
        out.append(copy)
        nbytes += host.untyped_storage().nbytes()
    return out, nbytes


def run_with(call: LayerCall, copies: LayerCopies, tensors: list[torch.Tensor], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """Run `call` with each copied parameter replaced by its device copy (tied names get
    the same tensor)."""
    swapped = {key: tensors[index] for key, index in copies.keys}
    return torch.func.functional_call(call, swapped, args, kwargs, tie_weights=False, strict=False)


#: Where one copied parameter lives, bound at post_init for the eager path: (its name in
#: the layer, the module holding it, that module's ``_parameters`` dict, its key there,
#: the Parameter, its host copy).
Site = tuple[str, nn.Module, dict[str, Any], str, nn.Parameter, torch.Tensor]


def bind_sites(layer: int, module: nn.Module, copies: LayerCopies, store: HostStore) -> tuple[Site, ...]:
    """The sites of the layer's copied parameters, as they are now.

    Raises:
        ExecutionError: a parameter the layer copies is not there.
    """
    sites: list[Site] = []
    for name, owner in copies.entries:
        prefix, _, leaf = name.rpartition(".")
        holder = module.get_submodule(prefix) if prefix else module
        param = holder._parameters.get(leaf)
        if not isinstance(param, nn.Parameter):
            raise ExecutionError(f"layer {layer} parameter {name!r} vanished during post_init", name=name, value=layer)
        sites.append((name, holder, holder._parameters, leaf, param, host_of(store, owner)))
    return tuple(sites)


def holder_now(module: nn.Module, name: str) -> nn.Module | None:
    """The module that holds parameter `name` of `module` now, through ``_modules`` only
    (cheap enough for every call), or None when the path no longer exists."""
    holder: nn.Module | None = module
    for part in name.split(".")[:-1]:
        holder = holder._modules.get(part) if holder is not None else None
    return holder


def grads_wanted(sites: tuple[Site, ...], copies: LayerCopies) -> tuple[bool, ...] | None:
    """Per owner of `copies`, whether a Parameter it stands for requires grad, read now (a
    user may freeze a model after post_init); None when none does (the common case, and
    free: nothing to set)."""
    if not any(site[4].requires_grad for site in sites):
        return None
    wanted = [False] * len(copies.owners)
    for site, (_, index) in zip(sites, copies.keys, strict=True):
        wanted[index] = wanted[index] or site[4].requires_grad
    return tuple(wanted)


def run_swapped(sites: tuple[Site, ...], copies: LayerCopies, tensors: list[torch.Tensor],
                forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                *, device_type: str = "cpu", grads: bool = False) -> Any:
    """Eager `run_with`: the layer's forward with each copied parameter's entry in its
    module's ``_parameters`` pointing at its device copy for the call, put back after
    (what `functional_call` does, without its generality). With `grads` (some copy
    requires grad) under autocast on `device_type`, autocast's cache is off for the call:
    it would keep those copies alive until the autocast region ends (module docstring)."""
    if grads and torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
        torch.set_autocast_cache_enabled(False)
        try:
            return run_swapped(sites, copies, tensors, forward, args, kwargs)
        finally:
            torch.set_autocast_cache_enabled(True)
    try:
        for (_, _, params, leaf, _, _), (_, index) in zip(sites, copies.keys, strict=True):
            params[leaf] = tensors[index]
        return forward(*args, **kwargs)
    finally:
        for _, _, params, leaf, param, _ in sites:  # every one, swapped or not yet
            params[leaf] = param


def check_capturable(layer: int, owners: Iterable[Ref], store: HostStore, runtime: Runtime, pin: PinDecision) -> None:
    """Refuse, before PyTorch does, to capture copies from pageable host memory.

    Raises:
        ExecutionError: some of the layer's copies would come from pageable memory; the
            message says whether pinning is off (and why) or fell back.
    """
    pageable = set()
    for owner in owners:
        host = host_of(store, owner)
        if host.numel() and not runtime.is_pinned(host):
            pageable.add(owner)
    if not pageable:
        return
    if not pin.pin:
        raise ExecutionError(
            f"cannot capture a CUDA graph of layer {layer}: its weights are copied on demand from "
            f"pageable host memory (pinning is off: {pin.explanation}), and PyTorch refuses "
            "host-to-device copies from pageable memory during capture. Run without CUDA graphs, or "
            "plan with pinning enabled",
            name="pin", value=False,
        )
    raise ExecutionError(
        f"cannot capture a CUDA graph of layer {layer}: pinning failed for {len(pageable)} of its host "
        "copies, which stayed in pageable memory and are copied on demand (see stats().pin_fallbacks), "
        "and PyTorch refuses host-to-device copies from pageable memory during capture",
        name="pin_fallbacks", value=store.fallbacks,
    )
