"""The prefetch wait and start as `torch.library` custom ops, so torch.compile keeps them.

Each op declares the layer's activation as mutated. The compiler cannot see what the ops
do (they wait for, or issue, copies into the static buffers the layer's weights live in),
so without that declaration it would be free to move them across the layer's kernels. The
fake implementations do nothing: the ops return nothing and change no metadata.

An offloader registers itself under an integer handle; the ops find it by that handle at
run time. Handles are plain ints so they trace as constants.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from offload.errors import ExecutionError

__all__ = ["PrefetchTarget", "register", "start_prefetch", "unregister", "wait_prefetch"]


class PrefetchTarget(Protocol):
    """What the ops call back into: the prefetch executor."""

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait for the copy of the layer's weights."""
        ...

    def start_after_layer(self, layer: int) -> None:
        """Issue the copy the schedule names after the layer's forward."""
        ...


# Weak: the model's patched forwards keep an offloader alive; the registry must not keep
# one alive after its model is gone.
_targets: weakref.WeakValueDictionary[int, PrefetchTarget] = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_lock = threading.Lock()


def register(target: PrefetchTarget) -> int:
    """Make `target` reachable from the ops; returns its handle."""
    with _lock:
        handle = next(_handles)
        _targets[handle] = target
    return handle


def unregister(handle: int) -> None:
    """Forget a handle (restore); calls with it afterwards raise `ExecutionError`."""
    with _lock:
        _targets.pop(handle, None)


def _target(handle: int) -> PrefetchTarget:
    target = _targets.get(handle)
    if target is None:
        raise ExecutionError(
            f"offloader handle {handle} is not registered: the model was restored, or the "
            "offloader was never set up (wrap_modules, then post_init)",
            name="handle",
            value=handle,
        )
    return target


@torch.library.custom_op("offload::wait_prefetch", mutates_args=("activation",))
def wait_prefetch(activation: torch.Tensor, handle: int, layer: int) -> None:
    """Before an offloaded layer runs: wait until its weights are in their buffers."""
    _target(handle).wait_layer(layer)


@wait_prefetch.register_fake
def _wait_prefetch_fake(activation: torch.Tensor, handle: int, layer: int) -> None:
    return None


@torch.library.custom_op("offload::start_prefetch", mutates_args=("activation",))
def start_prefetch(activation: torch.Tensor, handle: int, layer: int) -> None:
    """After an offloaded layer ran: issue the copy the schedule names next."""
    _target(handle).start_after_layer(layer)


@start_prefetch.register_fake
def _start_prefetch_fake(activation: torch.Tensor, handle: int, layer: int) -> None:
    return None
