"""`NoopOffloader`: the backend for plans that offload nothing (backend none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.executors.common import check_layers
from offload.protocols import Runtime
from offload.pure.plan import Backend, OffloadPlan
from offload.stats import OffloadStats

__all__ = ["NoopOffloader"]


@final
class NoopOffloader:
    """Runs a plan whose backend is none: every parameter stays where it is.

    It still checks that the layers are the ones the plan describes, so a framework can
    switch backends by plan alone and get the same errors for the wrong model.

    Args:
        plan: a plan whose backend is none.
        runtime: used only for its device, to check the layers.

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

    @property
    def plan(self) -> OffloadPlan:
        """The plan (nothing offloaded)."""
        return self._plan

    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Check the layers against the plan and return them unchanged.

        Raises:
            ExecutionError: called twice.
            PlanError: the layers do not match the plan.
        """
        if self._wrapped:
            raise ExecutionError("wrap_modules was already called", name="state", value="wrapped")
        layers = list(layers)
        check_layers(self._plan, layers, self._rt.device)
        self._wrapped = True
        return layers

    def post_init(self) -> None:
        """Nothing to prepare: no parameter is offloaded."""

    def sync_prev_onload(self) -> None:
        """Nothing is ever in flight."""

    def join_after_forward(self) -> None:
        """Nothing is ever in flight."""

    def restore(self) -> None:
        """Nothing was moved; forgets the wrapped state so the layers can be wrapped again."""
        self._wrapped = False

    def stats(self) -> OffloadStats:
        """All zero: nothing is offloaded or copied."""
        return OffloadStats(wait_seconds=0.0)
