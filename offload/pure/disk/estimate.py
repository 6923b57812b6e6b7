"""The step of a plan run with its disk tier, predicted (`estimate_with_tier`): the prefetch
simulation of `offload.pure.fit.estimate` with one disk reading the disk layers into their
staging buffers, each read after the copy out of its buffer's previous occupant, and the
host thread waiting for a read before it issues the copy that reads the buffer."""

from __future__ import annotations

from offload.errors import PlanError
from offload.pure.disk.tier import DiskTierPlan, first_reads, next_occupants
from offload.pure.fit.estimate import DiskReads, StepEstimate, Workload, estimate
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.plan.plan import OffloadPlan

__all__ = ["disk_reads", "estimate_with_tier"]


def disk_reads(plan: OffloadPlan, tier: DiskTierPlan) -> DiskReads:
    """`tier` as the simulation sees it: each disk position's read time at the tier's
    `disk_gbps`, its buffer's next occupant, and the reads post_init starts (a pass's
    first copies in issue order, one per buffer, as the executor stages them).

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
        nbytes[p.layer] += p.nbytes
    rate = tier.disk_gbps * 1e9
    seconds = tuple(nbytes[layer_at[i]] / rate if i in layer_at else 0.0 for i in range(len(positions)))
    return DiskReads(seconds=seconds, next_of=tuple(next_occupants(tier, plan.schedule.cycle_of).items()),
                     first=first_reads(tier, plan.schedule.initial))


def estimate_with_tier(plan: OffloadPlan, tier: DiskTierPlan, profile: DeviceProfile,
                       workload: Workload) -> StepEstimate:
    """The steady-state step of `plan` run with `tier` on `profile` for `workload`,
    itemised per layer (`StepEstimate`; each disk layer's read in `disk_read_seconds`,
    its wait for a late read in `stall_seconds`).

    Raises:
        PlanError: `tier` is not the plan's.
    """
    return estimate(plan, profile, workload, disk=disk_reads(plan, tier))
