"""On-demand loading: a layer's forward run with device copies of its host-resident
weights, through `torch.func.functional_call` (``tie_weights=False``: tied names are given
the same device tensor explicitly). Module-level functions; the UVA executor holds the state.

The copies are queued on the compute stream by `Runtime.to_device`, ahead of the kernels
that read them, and freed by the allocator when the call returns. Nothing is prefetched:
this path is as slow as the link (the plan warns), and from pageable memory it cannot be
captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref, host_of, host_owner, raise_as_execution_error
from offload.executors.hoststore import HostStore
from offload.protocols import Runtime
from offload.pure.decisions import PinDecision
from offload.pure.plan import ParamPlan

__all__ = ["Entries", "LayerCall", "call_with_copies", "check_capturable", "on_demand_entries"]

#: Per layer: (parameter name within the layer, owner of its host copy), for every
#: parameter the layer copies per call.
Entries = tuple[tuple[str, Ref], ...]


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


def on_demand_entries(params: Iterable[ParamPlan], store: HostStore, viewed: set[Ref]) -> dict[int, Entries]:
    """Which parameters each layer copies per call: those whose host copy has no device view
    (placed ON_DEMAND, or UVA whose pinning fell back)."""
    table: dict[int, list[tuple[str, Ref]]] = {}
    for p in params:
        owner = host_owner(p, store)
        if owner is not None and owner not in viewed:
            table.setdefault(p.layer, []).append((p.name, owner))
    return {layer: tuple(entries) for layer, entries in table.items()}


def call_with_copies(
    call: LayerCall, entries: Entries, store: HostStore, runtime: Runtime, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, int, int]:
    """Run `call` with every entry's storage copied to the device, once per storage.

    Returns:
        The layer's output, the copies made and the bytes they moved.
    """
    on_device: dict[Ref, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for name, owner in entries:
        tensor = on_device.get(owner)
        if tensor is None:
            host = host_of(store, owner)
            try:
                tensor = on_device[owner] = runtime.to_device(host)
            except BaseException as exc:
                raise_as_execution_error(exc, f"the on-demand copy of layer {owner[0]} parameter {owner[1]!r} failed",
                                         owner[1])
            nbytes += host.untyped_storage().nbytes()
        tensors[f"layer.{name}"] = tensor  # tied names get the same tensor
    out = torch.func.functional_call(call, tensors, args, kwargs, tie_weights=False, strict=False)
    return out, len(on_device), nbytes


def check_capturable(layer: int, entries: Entries, store: HostStore, runtime: Runtime, pin: PinDecision) -> None:
    """Refuse, before PyTorch does, to capture copies from pageable host memory.

    Raises:
        ExecutionError: some of the layer's copies would come from pageable memory; the
            message says whether pinning is off (and why) or fell back.
    """
    pageable = set()
    for _, owner in entries:
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
