"""`NoopOffloader`: the backend for plans that offload nothing (backend none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from torch import nn
from torch.utils.hooks import RemovableHandle

from offload.errors import ExecutionError, PlanError
from offload.executors.common import normal_tensors, raise_as_execution_error
from offload.executors.hoststore import HostStore
from offload.executors.live import inspect_params
from offload.executors.placement.find import find_moves
from offload.executors.placement.marks import claim, mark, unmark
from offload.executors.placement.move import Undo, move_resident
from offload.executors.placement.restore import Restorer
from offload.executors.placement.unpack import unpack
from offload.executors.reload import Weights, write_weights
from offload.protocols import Runtime
from offload.pure.check import LiveCheck
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.stats import OffloadStats

__all__ = ["NoopOffloader"]


@final
class NoopOffloader:
    """Runs a plan whose backend is none: nothing is offloaded, and every weight ends on
    the compute device (weights in host memory are copied there, weights on meta get
    uninitialised device storage; `restore` gives host weights back to the host).

    It checks that the layers are the ones the plan describes, so a framework can switch
    backends by plan alone and get the same errors for the wrong model.

    Args:
        plan: a plan whose backend is none.
        runtime: the effects (device copies and allocations).

    Raises:
        PlanError: the plan's backend is not none.
    """

    def __init__(self, plan: OffloadPlan, runtime: Runtime) -> None:
        if plan.backend is not Backend.NONE:
            raise PlanError(f"NoopOffloader runs plans with backend none, got {plan.backend.value}",
                            name="backend", value=plan.backend.value)
        self._plan = plan
        self._rt = runtime
        self._wrapped = False
        self._restorer: Restorer | None = None
        self._hooks: list[RemovableHandle] = []  # state_dict hooks of unpacked quantised weights
        self._layers: list[nn.Module] = []

    @property
    def plan(self) -> OffloadPlan:
        """The plan (nothing offloaded)."""
        return self._plan

    @normal_tensors
    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Check the layers against the plan and return them unchanged.

        Raises:
            ExecutionError: called twice.
            PlanError: the layers do not match the plan.
        """
        if self._wrapped:
            raise ExecutionError("wrap_modules was already called", name="state", value="wrapped")
        layers = list(layers)
        claim(layers, self)
        unpacked = unpack(layers)  # quantised weights: named by their inner tensors, as planned
        undo = Undo()
        store = HostStore(self._rt, pin=self._plan.pin.method)  # stays empty: nothing is offloaded
        try:
            found = find_moves(self._plan, layers, self._rt.device)
            from_host = move_resident(self._plan, layers, found, self._rt, undo, {})
        except BaseException as exc:
            undo.run(store, self._rt)
            unpacked.pack()
            raise_as_execution_error(exc, "moving weights to the device failed, model left as it was",
                                     "wrap_modules")
        self._restorer = Restorer(layers, store, {}, from_host, self._rt, unpacked=unpacked)
        self._hooks = unpacked.hooks(layers, range(len(layers)))
        self._layers = layers
        mark(layers, self)
        self._wrapped = True
        return layers

    @normal_tensors
    def post_init(self) -> None:
        """Nothing to prepare: no parameter is offloaded."""

    @normal_tensors
    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """Write new weights into the parameters and buffers of the layers, in place (as
        the other backends do; nothing is offloaded here, so `skip_read_only` changes
        nothing).

        Raises:
            ExecutionError: not wrapped, or a name, shape or copy is wrong (see `write_weights`).
        """
        if not self._wrapped:
            raise ExecutionError("load_weights needs a wrapped model", name="state", value="new")
        write_weights(weights, self._plan, self._layers, HostStore(self._rt, pin=self._plan.pin.method), prefix=prefix,
                      skip_read_only=skip_read_only)

    def sync_prev_onload(self) -> None:
        """Nothing is ever in flight."""

    def join_after_forward(self) -> None:
        """Nothing is ever in flight."""

    @normal_tensors
    def restore(self) -> None:
        """Give weights that came from host memory back to it; forget the wrapped state
        so the layers can be wrapped again.

        Raises:
            ExecutionError: a copy back failed (retry `restore` to finish).
        """
        if self._restorer is not None:
            self._restorer.run(self._plan)
        self._restorer = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        unmark(self._layers)
        self._layers = []
        self._wrapped = False

    def check(self) -> LiveCheck:
        """Where every planned parameter is now (all resident: on the device).

        Raises:
            ExecutionError: the model is not wrapped.
        """
        if not self._wrapped:
            raise ExecutionError("check needs a wrapped model", name="state", value="new")
        return inspect_params(self._plan, self._layers, self._rt, ready=True)

    def stats(self) -> OffloadStats:
        """All zero: nothing is offloaded or copied."""
        return OffloadStats(wait_seconds=0.0)
