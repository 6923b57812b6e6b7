"""The step of a plan run with its disk tier, predicted (`estimate_with_tier`): the prefetch
simulation of `offload.pure.fit.estimate` with one disk reading the disk layers into their
staging buffers, each read after the copy out of its buffer's previous occupant, and the
host thread waiting for a read before it issues the copy that reads the buffer.

An expert cache's experts are not in the staging ring's reads (the ring never reads them,
`DiskParam.in_place`): the cache reads the experts it misses (over a routing trace, or
their worst case, `offload.pure.experts.expected.bounded_loads`) from the files at the
module's call, and the layer waits for those reads."""

from __future__ import annotations

from offload.errors import PlanError
from offload.pure.disk.tier import DiskTierPlan, first_reads, next_occupants
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import DiskReads, StepEstimate, Workload, estimate
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.plan.plan import OffloadPlan

__all__ = ["disk_reads", "estimate_with_tier"]


def disk_reads(plan: OffloadPlan, tier: DiskTierPlan, *, in_place: bool = False) -> DiskReads:
    """`tier` as the simulation sees it: each disk position's read time at the tier's
    `disk_gbps`, its buffer's next occupant, and the reads post_init starts (a pass's
    first copies in issue order, one per buffer, as the executor stages them).

    With `in_place`, the parameters read in place (an expert cache's) are left out of the
    positions' reads, and their layers are `DiskReads.expert_layers`; without it they are
    read with their layers (every expert every pass, the worst case).

    Raises:
        PlanError: `tier` puts a layer at a position the plan does not.
    """
    positions = plan.offloaded_layers
    layer_at = dict(zip(tier.disk_positions, tier.disk_layers, strict=True))
    if any(position >= len(positions) or positions[position] != layer for position, layer in layer_at.items()):
        raise PlanError("the disk tier is not this plan's (its positions hold other layers)", name="disk_positions",
                        value=tier.disk_positions)
    nbytes = dict.fromkeys(tier.disk_layers, 0)
    for p in tier.params:
        if not (in_place and p.in_place):
            nbytes[p.layer] += p.nbytes
    rate = tier.disk_gbps * 1e9
    seconds = tuple(nbytes[layer_at[i]] / rate if i in layer_at else 0.0 for i in range(len(positions)))
    experts = sorted({p.layer for p in tier.params if p.in_place}) if in_place else []
    return DiskReads(seconds=seconds, next_of=tuple(next_occupants(tier, plan.schedule.cycle_of).items()),
                     first=first_reads(tier, plan.schedule.initial), expert_layers=tuple(experts), bytes_per_s=rate)


def estimate_with_tier(plan: OffloadPlan, tier: DiskTierPlan, profile: DeviceProfile,
                       workload: Workload, *, routing: RoutingTrace | None = None) -> StepEstimate:
    """The steady-state step of `plan` run with `tier` on `profile` for `workload`,
    itemised per layer (`StepEstimate`; each disk layer's read in `disk_read_seconds`,
    its wait for a late read in `stall_seconds`); with `routing`, the expert caches'
    copies and disk reads per step from the trace, without it their worst case
    (`offload.pure.fit.estimate.estimate`).

    Raises:
        PlanError: `tier` is not the plan's; `routing` as `estimate` says.
    """
    return estimate(plan, profile, workload, disk=disk_reads(plan, tier, in_place=True), routing=routing)
