"""A disk tier for people: the three tiers' bytes, the ring, and why parameters spill."""

from __future__ import annotations

from offload.pure.disk.tier import DiskSource, DiskTierPlan
from offload.pure.fit.step import StepEstimate
from offload.pure.plan.plan import OffloadPlan, PlanWarning, WarningCode
from offload.pure.units import format_bytes

__all__ = ["render_disk_tier", "tier_warnings"]


def tier_warnings(plan: OffloadPlan, tier: DiskTierPlan, step: StepEstimate) -> tuple[PlanWarning, ...]:
    """`plan`'s warnings as they stand with `tier` and its estimate `step`
    (`estimate_with_tier`): when the disk's reads bound the step (they take longer than
    the resident compute and the link), a deeper prefetch helps nothing, so the plan's
    ``prefetch_stalls`` advice gives way to a ``disk_bound`` warning that says what does:
    a host budget that holds more layers, or a faster disk."""
    floor = step.disk_read_seconds
    if not tier.disk_positions or floor <= max(step.compute_seconds, step.link_seconds):
        return plan.warnings
    layer = max(tier.disk_bytes // len(tier.disk_positions), 1)
    kept = [w for w in plan.warnings if w.code is not WarningCode.PREFETCH_STALLS]
    return (*kept, PlanWarning(code=WarningCode.DISK_BOUND, message=(
        f"the step is bound by the disk tier's reads: {floor * 1e3:.1f} ms per step at {tier.disk_gbps:g} GB/s, "
        f"against {max(step.compute_seconds, step.link_seconds) * 1e3:.1f} ms of compute or copies, so no prefetch "
        f"depth helps; each {format_bytes(layer)} more of host budget keeps about one more layer off the disk "
        f"({format_bytes(tier.disk_bytes)} more keeps them all), or read from a faster disk")))


def _ranges(values: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for value in sorted(values):
        if out and out[-1].rsplit("-", 1)[-1] == str(value - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{value}"
        else:
            out.append(str(value))
    return ", ".join(out)


def render_disk_tier(tier: DiskTierPlan, *, device_bytes: int) -> str:
    """The disk tier in a few lines: which layers, host memory against its budget, what is
    read from where per pass and how long that takes at the disk's rate.

    Args:
        tier: the disk tier.
        device_bytes: the device tier's bytes (resident weights and buffers), for the
            three-tier line.
    """
    disk = len(tier.disk_layers)
    lines = [
        f"tiers:    device {format_bytes(device_bytes)}, host {format_bytes(tier.host_tier_bytes)}, "
        f"disk {format_bytes(tier.disk_bytes)}",
    ]
    if not disk:
        lines.append(f"disk:     none: the offloaded weights fit the host budget of "
                     f"{format_bytes(tier.host_budget_bytes)}")
        return "\n".join(lines)
    lines.append(
        f"disk:     {disk} layer{'s' if disk != 1 else ''} on disk (layers {_ranges(tier.disk_layers)}), read "
        f"at least {tier.lead} cop{'ies' if tier.lead != 1 else 'y'} ahead into {tier.buffers} staging "
        f"buffer{'s' if tier.buffers != 1 else ''} of {format_bytes(tier.staging_bytes)}")
    lines.append(
        f"host:     {format_bytes(tier.host_tier_bytes)} of host copies + {format_bytes(tier.staging_ring_bytes)} "
        f"staging = {format_bytes(tier.host_bytes)} (budget {format_bytes(tier.host_budget_bytes)})")
    mapped = tier.disk_bytes - tier.spill_bytes
    lines.append(
        f"reads:    {format_bytes(mapped)} per pass from the checkpoint as it lies ({len(tier.files)} "
        f"file{'s' if len(tier.files) != 1 else ''}), {format_bytes(tier.spill_bytes)} from a spill file written "
        f"once; at {tier.disk_gbps:g} GB/s a pass reads for at least {tier.read_seconds * 1e3:.1f} ms")
    reasons: dict[str, int] = {}
    for p in tier.params:
        if p.source is DiskSource.SPILL:
            reasons[p.reason] = reasons.get(p.reason, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0]))[:3]:
        lines.append(f"spill:    {count} parameter{'s' if count != 1 else ''}: {reason}")
    if len(reasons) > 3:
        lines.append(f"spill:    ... and {len(reasons) - 3} other reasons")
    return "\n".join(lines)
