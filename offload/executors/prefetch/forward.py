"""The forwards a prefetch offloader installs on its layers: the eager one calls the copy
queue directly (Note [ordering]); the one torch.compile traces goes through the custom ops,
which declare the slot tensors mutated (`offload.executors.ops`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload.executors import ops
from offload.executors.common import first_float_tensor, profiling, refuse_autograd
from offload.executors.prefetch.queue import CopyQueue

__all__ = ["ForwardPath"]


class ForwardPath(CopyQueue):
    """A layer's forward, eager and compiled."""

    def _wrap_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        names = tuple(p.name for p in self._plan.offloaded_params if p.layer == layer)
        compiled = self._compiled_forward(layer, forward, names)
        is_compiling = torch.compiler.is_compiling

        def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
            # Eager: the executor is called directly (the custom ops, their dispatch and
            # aliasing checks, are for torch.compile, which must see the ordering).
            if is_compiling():
                return compiled(*args, **kwargs)
            if torch.is_grad_enabled():
                refuse_autograd(layer, self._layers[layer], names, args, kwargs)
            # wait_layer and start_after_layer, with the position looked up once for both
            # (Note [ordering]).
            # The capture state is asked each time: a manual capture may begin or end
            # inside the layer, and the copy issued after it must be tagged as it is.
            position = self._position(layer)
            if position is None:
                return forward(*args, **kwargs)
            if profiling():
                with torch.profiler.record_function(f"offload.wait layer {layer}"):
                    self._wait_at(position, self._rt.is_capturing())
                out = forward(*args, **kwargs)
                with torch.profiler.record_function(f"offload.copy after layer {layer}"):
                    if not (self._recovering and self._cycle_of[position] in self._recovering):
                        self._start_at(position, self._rt.is_capturing())
                return out
            self._wait_at(position, self._rt.is_capturing())
            out = forward(*args, **kwargs)
            if not (self._recovering and self._cycle_of[position] in self._recovering):
                self._start_at(position, self._rt.is_capturing())
            return out

        return offloaded_forward

    def _compiled_forward(self, layer: int, forward: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
        """The forward torch.compile traces: the wait and the start as custom ops that
        declare the layer's slot tensors mutated (see `ops`)."""
        handle = self._handle
        if ops.bound_slots(handle) is None:
            # The slot tensors of each layer, as the ops are handed them: its offloaded
            # parameters (whose data are slot buffers), each once, as post_init found them.
            # Holds the offloader weakly (the ops' registry outlives no model).
            owner = weakref.ref(self)

            def slot_tensors(index: int) -> Sequence[torch.Tensor]:
                offloader = owner()
                return () if offloader is None else offloader._slot_params.get(index, ())

            ops.bind_slots(handle, slot_tensors)

        def compiled_forward(*args: Any, **kwargs: Any) -> Any:
            refuse_autograd(layer, self._layers[layer], names, args, kwargs)
            activation = first_float_tensor((*args, *kwargs.values()))
            if activation is None:
                self.wait_layer(layer)
            else:
                ops.wait_prefetch(activation, list(self._slot_params.get(layer, ())), handle, layer)
            out = forward(*args, **kwargs)
            produced = first_float_tensor((out,))
            if produced is None:
                produced = activation
            if produced is None:
                self.start_after_layer(layer)
            else:
                # The layer whose copy the start issues: its slot is the one overwritten.
                position = self._position_of.get(layer)
                after = None if position is None else self._next_after[position]
                target = ops.NO_LAYER if after is None else self._plan.offloaded_layers[after]
                overwritten = [] if target == ops.NO_LAYER else list(self._slot_params.get(target, ()))
                ops.start_prefetch(produced, overwritten, handle, layer, target)
            return out

        return compiled_forward
