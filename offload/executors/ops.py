"""The prefetch wait and start as `torch.library` custom ops, so torch.compile keeps them
and orders every read of a static buffer after the op that fills it.

The compiler cannot see what the ops do (they wait for, or issue, copies into the static
buffers the layers' weights live in), so each op declares what it changes:

- `wait_prefetch` mutates the layer's activation (ordering it after the previous layer's
  ops) and the layer's parameters, i.e. its slot tensors: every later read of a weight
  then reads the op's result, so no kernel that uses only weights (int8 dequantisation,
  a weight transpose) can be scheduled above the wait, whatever order inductor picks.
- `start_prefetch` mutates the output the layer produced and the parameters of the layer
  whose copy it issues (the slot that copy overwrites): every read of that slot by the
  layer that just ran is ordered before the op, so the copy cannot overtake it.

Under the eager path and inductor (which re-inplaces the ops, see
`torch/_inductor/fx_passes/reinplace.py`), the ops receive the parameters themselves and
only wait or issue copies. A compile path that functionalises without re-inplacing
(``backend="aot_eager"``) hands the ops fresh copies of the parameters and writes the
copies' final values back into the parameters after the graph. The ops then keep their
promise literally: the wait copies the layer's weights into what it was handed, and the
start lets its copy land first (`PrefetchTarget.wait_for_copies`) and copies the result, so the
write-back puts back exactly what the buffers hold. That is correct and slow (a debugging
backend); it is logged once, and it cannot run inside a CUDA graph capture.

CUDA graph trees (``torch.compile(mode="reduce-overhead")``). The ops carry
``torch.Tag.cudagraph_unsafe`` where the installed torch has it: inductor then runs them
outside its CUDA graphs (with graph partitioning, the default, it captures the kernels
between them; without it, it skips CUDA graphs for that graph and logs why). They must
not be captured by cudagraph trees, whose warm-up and re-recording would issue and wait
for copies the executor cannot account for. Capturing a whole forward is
`offload.graphs.capture_forward`'s job.

The on-demand path (`UVAOffloader`'s layers whose weights are copied per call) has one
op, `copy_on_demand`: it returns fresh device copies of a layer's host copies, which the
layer's forward then runs with. It mutates nothing; it takes the layer's input so that it
cannot be scheduled before the layer is reached (which would keep every layer's copies
alive at once). Its fake implementation returns empty tensors of the copies' layouts.

Eager forwards do not go through the ops: they call the executor directly, and take the
op path only while `torch.compiler.is_compiling()` (dynamo, torch.export). A bare
``make_fx``/``aot_function`` trace outside dynamo therefore runs the executor once at
trace time and records no op: trace through torch.compile or torch.export instead. Under
``mode="reduce-overhead"`` each `copy_on_demand` ends a CUDA graph partition, and graph
trees copy its outputs into their static inputs on every replay: on-demand weights then
cost one host-to-device and one device-to-device copy per forward (prefer the prefetch
backend, or `offload.graphs.capture_forward`, with CUDA graphs).

An offloader registers itself under an integer handle; the ops find it by that handle at
run time. Handles are plain ints so they trace as constants. The prefetch ops' fake
implementations do nothing: they return nothing and change no metadata.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from offload.errors import ExecutionError
from offload.logs import logger

__all__ = [
    "OPS_TAGS",
    "NO_LAYER",
    "CopyLayout",
    "OnDemandTarget",
    "PrefetchTarget",
    "SlotTensors",
    "bind_slots",
    "bound_slots",
    "copy_on_demand",
    "register",
    "register_on_demand",
    "start_prefetch",
    "unregister",
    "wait_prefetch",
]

log = logger("offload.compile")

#: `start_prefetch`'s ``target`` when the schedule names no copy after the layer.
NO_LAYER = -1


class PrefetchTarget(Protocol):
    """What the ops call back into: the prefetch executor."""

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for the copy of the layer's weights."""
        ...

    def start_after_layer(self, layer: int) -> None:
        """Issue the copy the schedule names after the layer's forward."""
        ...

    def wait_for_copies(self) -> None:
        """Block until every copy issued so far is done (nothing else: mid-forward)."""
        ...


#: (shape, stride, dtype, device) of one on-demand copy.
CopyLayout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


class OnDemandTarget(Protocol):
    """What `copy_on_demand` calls back into: the UVA executor's on-demand layers."""

    def copies_for(self, layer: int) -> list[torch.Tensor]:
        """Fresh device copies of the layer's host copies, in the layer's copy order."""
        ...

    def copy_layouts(self, layer: int) -> list[CopyLayout]:
        """The layouts of what `copies_for` returns, for tracing."""
        ...


#: A layer index -> that layer's tensors, exactly as the executor hands them to the ops
#: (same order): the parameters whose data are slot buffers.
SlotTensors = Callable[[int], Sequence[torch.Tensor]]

# Weak: the model's patched forwards keep an offloader alive; the registry must not keep
# one alive after its model is gone. The slot resolvers hold their offloader weakly.
_targets: weakref.WeakValueDictionary[int, PrefetchTarget] = weakref.WeakValueDictionary()
_on_demand: weakref.WeakValueDictionary[int, OnDemandTarget] = weakref.WeakValueDictionary()
_slots: dict[int, SlotTensors] = {}
_copied_once: set[int] = set()  # handles whose ops were handed copies (logged once)
_handles = itertools.count(1)
_lock = threading.Lock()


def _tags() -> tuple[torch.Tag, ...]:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)  # torch >= 2.8
    return (tag,) if isinstance(tag, torch.Tag) else ()


#: The tags both ops carry: ``cudagraph_unsafe`` when this torch defines it.
OPS_TAGS: tuple[torch.Tag, ...] = _tags()


def register(target: PrefetchTarget) -> int:
    """Make `target` reachable from the ops; returns its handle."""
    with _lock:
        handle = next(_handles)
        _targets[handle] = target
    return handle


def register_on_demand(target: OnDemandTarget) -> int:
    """Make `target` reachable from `copy_on_demand`; returns its handle."""
    with _lock:
        handle = next(_handles)
        _on_demand[handle] = target
    return handle


def bind_slots(handle: int, slots: SlotTensors) -> None:
    """Tell the ops where the real slot tensors of `handle`'s layers are, so that they can
    tell when a compile path handed them copies (see the module docstring)."""
    with _lock:
        _slots[handle] = slots


def bound_slots(handle: int) -> SlotTensors | None:
    """What `bind_slots` bound to `handle`, if anything."""
    return _slots.get(handle)


def unregister(handle: int) -> None:
    """Forget a handle (restore); calls with it afterwards raise `ExecutionError`."""
    with _lock:
        _targets.pop(handle, None)
        _on_demand.pop(handle, None)
        _slots.pop(handle, None)
        _copied_once.discard(handle)


def _unregistered(handle: int) -> ExecutionError:
    return ExecutionError(
        f"offloader handle {handle} is not registered: the model was restored, or the "
        "offloader was never set up (wrap_modules, then post_init)",
        name="handle",
        value=handle,
    )


def _target(handle: int) -> PrefetchTarget:
    target = _targets.get(handle)
    if target is None:
        raise _unregistered(handle)
    return target


def _on_demand_target(handle: int) -> OnDemandTarget:
    target = _on_demand.get(handle)
    if target is None:
        raise _unregistered(handle)
    return target


def _same_memory(given: torch.Tensor, actual: torch.Tensor) -> bool:
    return given.numel() == 0 or (given.data_ptr() == actual.data_ptr() and given.device == actual.device)


def _copies_handed(handle: int, layer: int, given: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (handed copy, real slot tensor) pairs where the compiler handed the op a copy
    instead of the slot tensor itself; empty on the eager and re-inplaced paths."""
    slots = _slots.get(handle)
    if slots is None or not given:
        return []
    actual = slots(layer)
    if len(actual) != len(given):
        raise ExecutionError(
            f"offloaded layer {layer}: the op was handed {len(given)} weight tensors, the layer has "
            f"{len(actual)} (the model changed after it was compiled; compile it again)",
            name="layer", value=layer,
        )
    pairs = [(g, a) for g, a in zip(given, actual, strict=True) if not _same_memory(g, a)]
    if pairs and handle not in _copied_once:
        _copied_once.add(handle)
        log.info("torch.compile handed the prefetch ops copies of the weight buffers (a backend that "
                 "does not re-inplace, such as aot_eager): weights are copied into them and each "
                 "prefetch is waited for at once; correct, but slow")
    return pairs


@torch.library.custom_op("offload::wait_prefetch", mutates_args=("activation", "weights"), tags=OPS_TAGS)
def wait_prefetch(activation: torch.Tensor, weights: list[torch.Tensor], handle: int, layer: int) -> None:
    """Before an offloaded layer runs: wait until its weights are in their buffers.

    Args:
        activation: the layer's input (ordering only).
        weights: the layer's slot tensors (its offloaded parameters), as `bind_slots` says.
        handle: the offloader's handle.
        layer: the layer's index.
    """
    _target(handle).wait_layer(layer)
    for given, actual in _copies_handed(handle, layer, weights):
        given.copy_(actual)


@wait_prefetch.register_fake
def _wait_prefetch_fake(activation: torch.Tensor, weights: list[torch.Tensor], handle: int, layer: int) -> None:
    return None


@torch.library.custom_op("offload::start_prefetch", mutates_args=("activation", "weights"), tags=OPS_TAGS)
def start_prefetch(activation: torch.Tensor, weights: list[torch.Tensor], handle: int, layer: int,
                   target: int) -> None:
    """After an offloaded layer ran: issue the copy the schedule names next.

    Args:
        activation: the layer's output (ordering only).
        weights: the slot tensors that copy overwrites (the parameters of layer `target`).
        handle: the offloader's handle.
        layer: the layer that ran.
        target: the layer whose weights the copy brings, or `NO_LAYER`.

    Raises:
        ExecutionError: handed copies (see the module docstring) inside a CUDA graph capture.
    """
    offloader = _target(handle)
    offloader.start_after_layer(layer)
    if target == NO_LAYER:
        return
    pairs = _copies_handed(handle, target, weights)
    if not pairs:
        return
    try:
        offloader.wait_for_copies()
    except ExecutionError:
        raise
    except RuntimeError as exc:
        raise ExecutionError(
            "this torch.compile backend functionalises the prefetch ops without re-inplacing them "
            "(e.g. aot_eager), which needs a synchronisation that a CUDA graph capture forbids: "
            "compile with inductor (the default) or run the model eagerly",
            name="layer", value=layer,
        ) from exc
    for given, actual in pairs:
        given.copy_(actual)


@start_prefetch.register_fake
def _start_prefetch_fake(activation: torch.Tensor, weights: list[torch.Tensor], handle: int, layer: int,
                         target: int) -> None:
    return None


@torch.library.custom_op("offload::copy_on_demand", mutates_args=(), tags=OPS_TAGS)
def copy_on_demand(activation: torch.Tensor | None, handle: int, layer: int) -> list[torch.Tensor]:
    """Before an on-demand layer runs: device copies of its host copies, made for this call.

    Args:
        activation: the layer's input, if it has one (ordering only: the copies are made
            when the layer is reached, and freed after it).
        handle: the offloader's handle.
        layer: the layer's index.

    Returns:
        One fresh tensor per host copy the layer reads, in its copy order.
    """
    return _on_demand_target(handle).copies_for(layer)


@copy_on_demand.register_fake
def _copy_on_demand_fake(activation: torch.Tensor | None, handle: int, layer: int) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in _on_demand_target(handle).copy_layouts(layer)]
