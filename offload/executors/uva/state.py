"""What a UVA offloader holds: every field, set once here with what it means, the plan as
it runs (pinning fallbacks shown on demand) and the counters.

The parts build on it in one line, each using only what lies below it: `HostViews`
(`views.py`) → `OnDemand` (`forward.py`) → `UVAOffloader` (`offloader.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload.errors import PlanError
from offload.executors.common import Patched, Ref, host_owner
from offload.executors.hoststore import HostSource, HostStore
from offload.executors.lifecycle import Lifecycle
from offload.executors.ondemand import LayerCopies, Site
from offload.executors.placement.restore import Restorer
from offload.executors.telemetry import StepLog
from offload.protocols import Runtime
from offload.pure.plan.plan import Backend, OffloadPlan, Placement
from offload.pure.plan.revise import demote_to_on_demand
from offload.pure.stats import OffloadStats

__all__ = ["UVAState"]


_RUNS = frozenset({Placement.UVA, Placement.ON_DEMAND})


class UVAState:
    """The fields of a UVA offloader and their meaning (see `UVAOffloader`)."""

    def __init__(self, plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None) -> None:
        if plan.backend is not Backend.UVA:
            raise PlanError(f"UVAOffloader runs uva plans, got backend {plan.backend.value}",
                            name="backend", value=plan.backend.value)
        for p in plan.offloaded_params:
            if p.placement not in _RUNS:
                raise PlanError(f"parameter {p.layer}:{p.name} is placed {p.placement.value}; a uva plan places "
                                "parameters uva or on_demand", name=p.name, value=p.placement.value)
            if p.placement is Placement.UVA and not (plan.uva.enabled and plan.pin.pin):
                raise PlanError(f"parameter {p.layer}:{p.name} is placed uva, but the plan has UVA "
                                f"{'on' if plan.uva.enabled else 'off'} and pinning {'on' if plan.pin.pin else 'off'}; "
                                "a zero-copy view needs both", name=p.name, value=p.placement.value)
        self._plan = plan
        self._rt = runtime
        self._state = Lifecycle.NEW
        self._layers: list[nn.Module] = []
        self._host = HostStore(runtime, pin=plan.pin.method, source=host_source)  # owner (layer, name) -> host copy
        self._data: dict[Ref, torch.Tensor] = {}  # owner -> what its parameters point at
        self._viewed: set[Ref] = set()  # owners whose parameters point at a device view
        self._deferred: set[Ref] = set()  # UVA owners loaded after wrapping: viewed at post_init
        self._sources: dict[str, torch.Tensor] = {}  # storage key of a view made here -> its host copy
        self._origin: dict[Ref, torch.device] = {}  # every offloaded (layer, name) -> where restore puts it
        self._restorer: Restorer | None = None
        self._hooks: list[Any] = []  # state_dict hook handles
        self._patched: dict[int, Callable[..., Any] | None] = {}  # layer index -> previous forward attr
        self._on_demand: dict[int, LayerCopies] = {}  # layer -> what it copies per call
        self._sites: dict[int, tuple[Site, ...]] = {}  # layer -> where its copied parameters are (post_init)
        self._running: set[int] = set()  # on-demand layers inside their forward (eager), for re-entry
        self._handle = 0  # for the on-demand op under torch.compile (registered by wrap_modules)
        self._dropped = 0
        self._copies_issued = 0
        self._bytes_copied = 0
        self._steps = 0
        self._first_on_demand: int | None = None  # the layer whose runs count as steps (post_init)
        self._last_on_demand: int | None = None  # the layer whose runs end a step (post_init)
        self._guards: Patched = []  # the other layers' refusing forwards while a restore is unfinished
        # id of a module holding offloaded parameters -> (it, its (key in _parameters,
        # Parameter, owner of its host copy)), for load_state_dict routing (post_init).
        self._held: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, Ref]]]] = {}
        self._load_hooks: list[Any] = []
        self._step_log = StepLog()

    @property
    def plan(self) -> OffloadPlan:
        """The plan being run; after `post_init`, revised for parameters that post-processing
        replaced or deleted; UVA parameters whose pinning fell back are shown ON_DEMAND,
        which is how they run."""
        fallen = {
            (p.layer, p.name)
            for p in self._plan.offloaded_params
            if p.placement is Placement.UVA and (owner := host_owner(p, self._host)) is not None
            and owner not in self._viewed and owner not in self._deferred
        }
        return demote_to_on_demand(self._plan, fallen, "pinning their host copies failed (a view needs pinned memory)")

    def stats(self) -> OffloadStats:
        """Counters since `wrap_modules`: on-demand copies (UVA reads are not copies), host
        bytes held, pin fallbacks; no device buffers."""
        active = self._state in (Lifecycle.WRAPPED, Lifecycle.READY)
        return OffloadStats(
            params_offloaded=len(self._plan.offloaded_params) if active else 0,
            params_dropped=self._dropped,
            host_bytes=self._host.nbytes,
            device_buffer_bytes=0,
            copies_issued=self._copies_issued,
            bytes_copied=self._bytes_copied,
            wait_seconds=None,
            pin_fallbacks=self._host.fallbacks,
            steps=self._steps,
        )
