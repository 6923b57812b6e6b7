"""The disk tier inside `fit`'s search: `TierSearch` is the `offload.pure.fit.host.HostTier`
that places each prefetch candidate within a host budget, putting its last offloaded
layers on disk exactly as `plan_disk_tier` would put the plan's, and costs it with their
reads; `fit_with_tier` runs the search and plans the winner's tier.

So with both a device budget and a host budget, `fit` chooses the fastest predicted
configuration that the two budgets allow: backend none, UVA whose host copies fit, or
prefetch with as few layers on disk as the host budget needs (the tier streams through the
prefetch slots; UVA reads its host copies in place and has no tier). A pair of budgets no
configuration meets is a `PlanError` naming the least host budget for the device budget
and the least device budget for the host budget.

Each layer's offloaded bytes and its packing in a staging buffer are read once, off a plan
that offloads every layer (prefetch offloads the same parameters of a layer whichever
layers it takes), so the search and `plan_disk_tier` of the chosen plan agree; `fit`
checks that they do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

import attrs

from offload.pure.config import OffloadConfig
from offload.pure.disk.choose import (
    disk_candidates,
    first_reads_of,
    least_host_bytes,
    next_occupants_of,
    read_order_of,
    tier_bytes,
    tier_positions,
)
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.params import layout, staged
from offload.pure.disk.tier import (
    DiskTierPlan,
    disk_params_by_layer,
    layer_bytes_of,
    plan_disk_tier,
    tied_layers,
)
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import DiskReads, StepEstimate, Workload, estimate
from offload.pure.fit.host import HostPlacement
from offload.pure.fit.profiles import DeviceProfile, planning_env
from offload.pure.fit.search import DEFAULT_MAX_PREFETCH_STEP, DEFAULT_RUNNERS_UP, FitResult, fit
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.plan.schedule import PrefetchSchedule
from offload.pure.spec.extents import DiskExtent, FileIdentity
from offload.pure.spec.safetensors import TensorHeader
from offload.pure.spec.values import ModelSpec

__all__ = ["TierFit", "TierSearch", "fit_with_tier", "tier_search"]


@final
class TierSearch:
    """A host budget and the disk tier that meets it, for `fit` (`HostTier`).

    Build it with `tier_search`. Args as `plan_disk_tier`'s, and `every`: a prefetch plan of
    the same model that offloads every layer the search may offload (`tier_search` makes it).
    """

    def __init__(self, every: OffloadPlan, *, host_budget_bytes: int, disk_gbps: float, read_ahead: int = 2,
                 layer_names: Sequence[str] = (), tensors: Mapping[str, TensorHeader] | None = None,
                 extents: Mapping[str, DiskExtent] | None = None, files: Sequence[FileIdentity] = ()) -> None:
        self._budget = host_budget_bytes
        self._rate = float(disk_gbps) * 1e9
        self._disk_gbps = float(disk_gbps)
        self._read_ahead = read_ahead
        self._names, self._tensors, self._extents, self._files = tuple(layer_names), tensors, extents, tuple(files)
        self._layer_bytes = layer_bytes_of(every)
        owned = disk_params_by_layer(every, layer_names, tensors or {}, extents or {})
        # The staging buffer of each layer with its expert caches (their experts read in
        # place) and streamed whole; what the ring reads where the misses are read at call.
        self._staged = {layer: layout(staged(found))[1] for layer, found in owned.items()}
        self._whole = {layer: layout(found)[1] for layer, found in owned.items()}
        self._ring_read = {layer: sum(p.nbytes for p in staged(found)) for layer, found in owned.items()}
        self._in_place = frozenset(layer for layer, found in owned.items() if any(p.in_place for p in found))
        self._tied = frozenset(tied_layers(every))

    @property
    def host_budget_bytes(self) -> int:
        """Host memory the offloaded weights and the staging ring may take, bytes."""
        return self._budget

    def _candidates(self, positions: Sequence[int], schedule: PrefetchSchedule) -> list[int]:
        return disk_candidates(len(positions), schedule.kept_positions, self._tied, positions)

    def place(self, positions: Sequence[int], schedule: PrefetchSchedule, *, caches: bool = True,
              at_call: bool = False) -> HostPlacement | None:
        """The candidate's disk positions, as `plan_disk_tier` would choose them, with their
        reads as the step simulation sees them (`disk_reads`, `in_place` as `at_call`
        says); None when none fits. `caches`: its MoE layers have expert caches (as the
        plan this search was built from), else are streamed whole."""
        candidates = self._candidates(positions, schedule)
        buffers = self._staged if caches else self._whole
        chosen = tier_positions(positions, self._layer_bytes, buffers, candidates,
                                host_budget_bytes=self._budget, read_ahead=self._read_ahead)
        if chosen is None:
            return None
        host, ring = tier_bytes(positions, self._layer_bytes, buffers, chosen, self._read_ahead)
        if not chosen:
            return HostPlacement(host_bytes=host)
        read_order = read_order_of(schedule.issued_after, set(chosen))
        staging = tuple(k % self._read_ahead for k in range(len(read_order)))
        at_call = at_call and caches
        read = self._ring_read if at_call else self._layer_bytes
        seconds = tuple(read.get(positions[i], 0) / self._rate if i in set(chosen) else 0.0
                        for i in range(len(positions)))
        experts = tuple(sorted(positions[i] for i in chosen if positions[i] in self._in_place)) if at_call else ()
        reads = DiskReads(seconds=seconds,
                          next_of=tuple(next_occupants_of(read_order, staging, schedule.cycle_of).items()),
                          first=first_reads_of(read_order, staging, schedule.initial), expert_layers=experts,
                          bytes_per_s=self._rate)
        return HostPlacement(host_bytes=host + ring, disk=reads, disk_positions=chosen)

    def least_host_bytes(self, positions: Sequence[int], schedule: PrefetchSchedule, *, caches: bool = True) -> int:
        """The least host memory the candidate takes with any count of layers on disk."""
        return least_host_bytes(positions, self._layer_bytes, self._staged if caches else self._whole,
                                self._candidates(positions, schedule), read_ahead=self._read_ahead)

    def tier(self, plan: OffloadPlan, env: EnvSnapshot | None = None) -> DiskTierPlan | None:
        """`plan_disk_tier` of a prefetch `plan` for this budget (None when every offloaded
        weight fits in host memory, or `plan` is not a prefetch plan)."""
        if plan.backend is not Backend.PREFETCH:
            return None
        found = plan_disk_tier(plan, host_budget_bytes=self._budget, disk_gbps=self._disk_gbps,
                               read_ahead=self._read_ahead, layer_names=self._names, tensors=self._tensors,
                               extents=self._extents, files=self._files, env=env)
        return found if found.disk_positions else None

    def estimate(self, plan: OffloadPlan, profile: DeviceProfile, workload: Workload, *,
                 routing: RoutingTrace | None = None) -> tuple[StepEstimate, int]:
        """The plan's step with its disk tier (over `routing`, where given), and the host
        memory it takes."""
        found = self.tier(plan)
        if found is None:
            return estimate(plan, profile, workload, routing=routing), plan.host_bytes
        return estimate_with_tier(plan, found, profile, workload, routing=routing), found.host_bytes


def tier_search(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, *, host_budget_bytes: int,
                disk_gbps: float, read_ahead: int = 2, param_filter: Sequence[str] = (),
                layer_names: Sequence[str] = (), tensors: Mapping[str, TensorHeader] | None = None,
                extents: Mapping[str, DiskExtent] | None = None,
                files: Sequence[FileIdentity] = (), expert_cache: bool = True) -> TierSearch:
    """The `TierSearch` of `spec` for `fit` against `env` and `profile` (the plan that
    offloads every layer is made as `fit` makes its plans: against `planning_env`, with
    expert caches as `fit`'s `expert_cache` says, whose parameters are read in place).

    Raises:
        PlanError: `read_ahead` below 1 or `disk_gbps` not positive; `layer_names` does
            not name every layer.
    """
    every = make_plan(spec, OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=1,
                                          param_filter=tuple(param_filter), expert_cache=expert_cache),
                      planning_env(env, profile))
    # Validates the options as plan_disk_tier does (a budget of everything: nothing on disk).
    plan_disk_tier(every, host_budget_bytes=every.host_bytes, disk_gbps=float(disk_gbps), read_ahead=read_ahead,
                   layer_names=layer_names, tensors=tensors, extents=extents, files=files)
    return TierSearch(every, host_budget_bytes=host_budget_bytes, disk_gbps=disk_gbps, read_ahead=read_ahead,
                      layer_names=layer_names, tensors=tensors, extents=extents, files=files)


@attrs.frozen(kw_only=True)
class TierFit:
    """What `fit_with_tier` chose: the fit (its estimate with the tier) and the tier."""

    fit: FitResult
    tier: DiskTierPlan | None


def fit_with_tier(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, workload: Workload,
                  device_budget_bytes: int, *, host_budget_bytes: int, disk_gbps: float, read_ahead: int = 2,
                  outside_bytes: int = 0, reserve_bytes: int = 0, param_filter: Sequence[str] = (),
                  max_prefetch_step: int = DEFAULT_MAX_PREFETCH_STEP, runners_up: int = DEFAULT_RUNNERS_UP,
                  layer_names: Sequence[str] = (), tensors: Mapping[str, TensorHeader] | None = None,
                  extents: Mapping[str, DiskExtent] | None = None,
                  files: Sequence[FileIdentity] = (), expert_cache: bool = True,
                  expert_slots: int | None = None, routing: RoutingTrace | None = None) -> TierFit:
    """`fit` within a device budget and a host budget together (see the module docstring),
    and the chosen plan's disk tier (None when its offloaded weights fit in host memory);
    over `routing` where given (`fit`'s), a disk layer's expert misses read at their call.

    Raises:
        ConfigError: as `fit`.
        PlanError: as `fit` and `tier_search`; no configuration meets both budgets.
    """
    search = tier_search(spec, env, profile, host_budget_bytes=host_budget_bytes, disk_gbps=disk_gbps,
                         read_ahead=read_ahead, param_filter=param_filter, layer_names=layer_names, tensors=tensors,
                         extents=extents, files=files, expert_cache=expert_cache)
    result = fit(spec, env, profile, workload, device_budget_bytes, outside_bytes=outside_bytes,
                 reserve_bytes=reserve_bytes, param_filter=param_filter, max_prefetch_step=max_prefetch_step,
                 runners_up=runners_up, host=search, expert_cache=expert_cache, expert_slots=expert_slots,
                 routing=routing)
    return TierFit(fit=result, tier=search.tier(result.plan, result.env))
