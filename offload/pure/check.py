"""What `check()` finds, as values: where every planned parameter really is, against where
the plan says (`LiveCheck`), where a placement means a parameter should be
(`expected_place`), and the text for people (`render_check`).

The live model is looked at by `offload.executors.live.inspect_params`; this module only
holds and reads its answer. A difference from the plan is listed, never fixed.
"""

from __future__ import annotations

import enum

import attrs

from offload.pure.plan.plan import OffloadPlan, ParamPlan, Placement

__all__ = ["FileCheck", "LiveCheck", "Location", "ParamLocation", "expected_place", "kept_on_host", "render_check"]


class Location(enum.Enum):
    """Where a parameter's data is."""

    DEVICE = "device"  # device memory of its own (resident)
    SLOT = "slot"  # a static prefetch buffer
    DEVICE_VIEW = "device view"  # a zero-copy device view of a pinned host copy
    HOST_PINNED = "host, pinned"
    HOST_PAGEABLE = "host, pageable"
    DISK = "disk"  # a disk-tier weight's copy: a private mapping of its file (before post_init)
    META = "meta"
    MISSING = "missing"  # no such parameter any more


@attrs.frozen
class ParamLocation:
    """One planned parameter, where the plan puts it and where it is.

    Attributes:
        layer: its layer.
        name: its name within the layer.
        placement: the plan's placement.
        expected: where that placement means its data should be now.
        actual: where it is.
        device: the device its data is on (empty when missing).
    """

    layer: int
    name: str
    placement: Placement
    expected: Location
    actual: Location
    device: str

    @property
    def ok(self) -> bool:
        """True when it is where the plan says."""
        return self.actual is self.expected


@attrs.frozen
class FileCheck:
    """A file a disk tier reads, as it is now against the plan.

    Attributes:
        path: the file.
        changes: the fields of its identity that differ from the plan's (size,
            mtime_ns, inode, device), ``("missing",)`` when it cannot be read; empty when
            it is as planned.
    """

    path: str
    changes: tuple[str, ...]


@attrs.frozen
class LiveCheck:
    """The result of `check()`.

    Attributes:
        params: every planned parameter, in plan order.
        device_bytes_held: bytes of the distinct device storages the planned parameters
            use (slots included once, zero-copy views not: they are host memory), plus
            slot buffers no parameter points at now.
        plan_device_bytes: what the plan expects that figure to be (resident weights and
            static buffers).
        disk_params: the parameters of the disk tier (none without one).
        files: the checkpoint files the disk tier reads, each against the plan.
        written_in_slots: prefetched parameters, as (layer, name), whose static slot holds
            other values than their host copy while it holds their layer: written in
            place through an alias of the slot (``param.data.copy_()``), which the next
            copy into the slot loses (give new weights with ``load_weights``). An experts
            module's parameters are not compared: their slots hold only the experts routed
            last (Note [expert cache]).
        expert_residents: each device expert cache's residents, as (layer, module,
            the experts in its slots, sorted); their slots count in `device_bytes_held`.
    """

    params: tuple[ParamLocation, ...]
    device_bytes_held: int
    plan_device_bytes: int
    disk_params: tuple[tuple[int, str], ...] = ()
    files: tuple[FileCheck, ...] = ()
    written_in_slots: tuple[tuple[int, str], ...] = ()
    expert_residents: tuple[tuple[int, str, tuple[int, ...]], ...] = ()

    @property
    def differences(self) -> tuple[ParamLocation, ...]:
        """The parameters that are not where the plan says."""
        return tuple(p for p in self.params if not p.ok)

    @property
    def changed_files(self) -> tuple[FileCheck, ...]:
        """The disk tier's files that are not as planned."""
        return tuple(f for f in self.files if f.changes)

    @property
    def ok(self) -> bool:
        """True when every planned parameter is where the plan says, no slot holds values
        written past its host copy, and every file the disk tier reads is as planned."""
        return not self.differences and not self.changed_files and not self.written_in_slots


def expected_place(plan: OffloadPlan, placement: Placement, *, ready: bool) -> Location:
    """Where a parameter with `placement` should be in an offloaded model (`ready`: after
    post_init; before it, prefetched weights are still in their host copies)."""
    host = Location.HOST_PINNED if plan.pin.pin else Location.HOST_PAGEABLE
    if placement is Placement.RESIDENT:
        return Location.DEVICE
    if placement is Placement.PREFETCH:
        return Location.SLOT if ready else host
    if placement is Placement.UVA:
        return Location.DEVICE_VIEW
    return host  # ON_DEMAND


def kept_on_host(plan: OffloadPlan, p: ParamPlan) -> bool:
    """True for a resident host weight that a CUDA plan with ``keep_host_params`` leaves
    in host memory (it is not moved to the device)."""
    return (p.placement is Placement.RESIDENT and plan.config.keep_host_params and plan.compute_device == "cuda"
            and p.param.device.startswith("cpu"))


def render_check(check: LiveCheck) -> str:
    """`check` for people: the counts per place, the device bytes, every difference."""
    counts: dict[Location, int] = {}
    for p in check.params:
        counts[p.actual] = counts.get(p.actual, 0) + 1
    verdict = ("every planned parameter is where the plan says" if not check.differences
               else f"{len(check.differences)} of {len(check.params)} parameters differ from the plan")
    lines = [
        "live check: " + verdict,
        "  places: " + (", ".join(f"{n} {place.value}" for place, n in counts.items()) or "no parameters"),
        f"  device bytes held: {check.device_bytes_held} (plan: {check.plan_device_bytes})",
    ]
    lines += [f"  layer {p.layer} {p.name}: planned {p.placement.value} ({p.expected.value}), is {p.actual.value}"
              + (f" on {p.device}" if p.device else "") for p in check.differences]
    if check.disk_params or check.files:
        lines.append(f"  disk tier: {len(check.disk_params)} parameters, read from {len(check.files)} checkpoint "
                     f"files ({len(check.changed_files)} changed since planning)")
        lines += [f"  file {f.path}: {', '.join(f.changes)} changed" for f in check.changed_files]
    lines += [f"  layer {layer} {name}: its slot holds values written past its host copy (param.data written in "
              "place?); the next copy loses them: give new weights with load_weights"
              for layer, name in check.written_in_slots]
    return "\n".join(lines)
