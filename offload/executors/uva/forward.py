"""The on-demand forward of a UVA offloader: a layer whose weights cannot be viewed gets a
forward that copies them to the device on the compute stream when it is called (eager),
or through the custom op (torch.compile), and runs with the copies in place
(`offload.executors.ondemand`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from offload.errors import ExecutionError
from offload.executors import ops
from offload.executors.common import first_float_tensor, host_of, patch_forward, profiling, refuse_autograd
from offload.executors.lifecycle import Lifecycle, refuse
from offload.executors.ondemand import (
    LayerCall,
    LayerCopies,
    Site,
    check_capturable,
    copy_layer,
    grads_wanted,
    holder_now,
    on_demand_layers,
    run_swapped,
    run_with,
)
from offload.executors.uva.views import HostViews

__all__ = ["OnDemand"]


class OnDemand(HostViews):
    """The layers that copy on demand, their forward and their copies."""

    def _hook_on_demand(self) -> None:
        """Work out which parameters each layer copies per call; hook layers that need it.

        A module that appears at several places of the stack (``[a, shared, b, shared]``)
        is one set of weights (the plan ties its later places to the first) and one
        forward: it is hooked once, under the first place it has, and copies that place's
        weights whichever place calls it."""
        copies = on_demand_layers(self._plan.offloaded_params, self._host, self._viewed)
        first: dict[int, int] = {}
        for index, module in enumerate(self._layers):
            first.setdefault(id(module), index)
        self._on_demand = {layer: c for layer, c in copies.items() if first[id(self._layers[layer])] == layer}
        for layer in self._on_demand:
            if layer not in self._patched:
                self._patched[layer] = patch_forward(self._layers[layer], functools.partial(self._wrap_forward, layer))

    def _wrap_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        call = LayerCall(self._layers[layer], forward)
        device_type = self._rt.device.type

        def on_demand_forward(*args: Any, **kwargs: Any) -> Any:
            copies = self._copies_of(layer)
            if copies is None:
                return forward(*args, **kwargs)
            if torch.is_grad_enabled():
                refuse_autograd(layer, self._layers[layer], copies.names, args, kwargs)
            if torch.compiler.is_compiling():
                activation = first_float_tensor((*args, *kwargs.values()))
                tensors = ops.copy_on_demand(activation, self._handle, layer)
                return run_with(call, copies, tensors, args, kwargs)
            if layer in self._running:  # the layer called itself: its copies are in place
                return forward(*args, **kwargs)
            sites = self._sites[layer]
            self._check_unchanged(layer, sites)  # data pointers: eager only
            grads = grads_wanted(sites, copies)  # the routes the Parameters take (module docstring)
            if profiling():
                with torch.profiler.record_function(f"offload.copy on demand layer {layer}"):
                    tensors = self._copy(layer, copies, grads)
            else:
                tensors = self._copy(layer, copies, grads)
            self._running.add(layer)
            try:
                return run_swapped(sites, copies, tensors, forward, args, kwargs, device_type=device_type,
                                   grads=grads is not None)
            finally:
                self._running.discard(layer)

        return on_demand_forward

    def _copies_of(self, layer: int) -> LayerCopies | None:
        if self._state is not Lifecycle.READY:
            refuse(self._state, "forward", f"layer {layer} copies its weights on demand and ran before post_init() "
                   "(post-processing may have replaced them: call post_init() first)", subject=f"layer {layer}")
        return self._on_demand.get(layer)

    def _check_unchanged(self, layer: int, sites: tuple[Site, ...]) -> None:
        """Refuse to run a layer whose copied parameters were replaced or no longer point at
        their host copies (changed after post_init): it would run with the old weights."""
        module = self._layers[layer]
        for name, holder, params, leaf, param, host in sites:
            if (params.get(leaf) is param and param.data_ptr() == host.data_ptr() and param.dtype == host.dtype
                    and holder_now(module, name) is holder):
                continue
            now = params.get(leaf)
            if holder_now(module, name) is not holder:
                what = "the module holding it was replaced"
            elif isinstance(now, torch.Tensor):
                what = f"now {now.dtype}, {tuple(now.shape)}"
            else:
                what = "now gone"
            raise ExecutionError(
                f"layer {layer} parameter {name!r} no longer points at its host copy: it was changed after "
                f"post_init ({what}; e.g. by model.to(), or a tensor assigned to it), and the layer would run "
                "with the old weights. Call restore() first (it keeps the new data), make the change, then "
                "offload again", name=name, value=layer)

    def copies_for(self, layer: int) -> list[torch.Tensor]:
        """Fresh device copies of the host copies `layer` reads on demand, counted in
        `stats()` (`ops.OnDemandTarget`; the eager path calls it directly).

        Raises:
            ExecutionError: not ready, a CUDA graph is being captured from pageable host
                memory, or a copy failed.
        """
        copies = self._copies_of(layer)
        return [] if copies is None else self._copy(layer, copies)

    def _copy(self, layer: int, copies: LayerCopies, grads: tuple[bool, ...] | None = None) -> list[torch.Tensor]:
        if layer == self._first_on_demand:
            self._steps += 1
        if self._rt.is_capturing():
            check_capturable(layer, copies.owners, self._host, self._rt, self._plan.pin)
        tensors, nbytes = copy_layer(copies, self._host, self._rt, grads)
        self._copies_issued += len(tensors)
        self._bytes_copied += nbytes
        if layer == self._last_on_demand and self._step_log.active:
            self._step_log.step(self._steps, self.stats)  # the step's copies are all counted now
        return tensors

    def copy_layouts(self, layer: int) -> list[ops.CopyLayout]:
        """What `copies_for(layer)` returns, as (shape, stride, dtype, device) (for tracing)."""
        copies = self._copies_of(layer)
        device = self._rt.device
        hosts = [host_of(self._host, owner) for owner in (copies.owners if copies is not None else ())]
        return [(tuple(h.shape), tuple(h.stride()), h.dtype, device) for h in hosts]
