"""`check()`: where every planned parameter really is, against where the plan says.

"Is offloading even on?" is answered by looking at the live model, not at the plan: each
planned parameter is found by name and classified by what its data is (a static slot
buffer, a zero-copy view of a host copy, a host copy pinned or pageable, other device
memory, meta, or gone). A difference from the plan is listed, never fixed.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence

import attrs
import torch
from torch import nn

from offload.executors.common import find_parameter
from offload.protocols import Runtime
from offload.pure.plan import OffloadPlan, ParamPlan, Placement

__all__ = ["LiveCheck", "Location", "ParamLocation", "expected_place", "inspect_params", "kept_on_host", "render_check"]


class Location(enum.Enum):
    """Where a parameter's data is."""

    DEVICE = "device"  # device memory of its own (resident)
    SLOT = "slot"  # a static prefetch buffer
    DEVICE_VIEW = "device view"  # a zero-copy device view of a pinned host copy
    HOST_PINNED = "host, pinned"
    HOST_PAGEABLE = "host, pageable"
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
class LiveCheck:
    """The result of `check()`.

    Attributes:
        params: every planned parameter, in plan order.
        device_bytes_held: bytes of the distinct device storages the planned parameters
            use (slots included once, zero-copy views not: they are host memory), plus
            slot buffers no parameter points at now.
        plan_device_bytes: what the plan expects that figure to be (resident weights and
            static buffers).
    """

    params: tuple[ParamLocation, ...]
    device_bytes_held: int
    plan_device_bytes: int

    @property
    def differences(self) -> tuple[ParamLocation, ...]:
        """The parameters that are not where the plan says."""
        return tuple(p for p in self.params if not p.ok)

    @property
    def ok(self) -> bool:
        """True when every planned parameter is where the plan says."""
        return not self.differences


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


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def inspect_params(plan: OffloadPlan, layers: Sequence[nn.Module], runtime: Runtime, *, ready: bool,
                   slots: Collection[torch.Tensor] = (), views: Collection[torch.Tensor] = (),
                   hosts: Collection[torch.Tensor] = ()) -> LiveCheck:
    """Classify every planned parameter of `layers`.

    Args:
        plan: the plan being run.
        layers: the wrapped layers.
        runtime: the runtime (its device and its notion of pinned).
        ready: post_init has run.
        slots: the static buffers (prefetch).
        views: the zero-copy device views made (UVA).
        hosts: the host copies held.
    """
    slot_ptrs = {_storage(t) for t in slots if t.numel()}
    view_ptrs = {_storage(t) for t in views if t.numel()}
    host_ptrs = {_storage(t) for t in hosts if t.numel()}
    device = runtime.device
    held: dict[int, int] = {}
    places: list[ParamLocation] = []
    for p in plan.params:
        expected = expected_place(plan, p.placement, ready=ready)
        param = find_parameter(layers[p.layer], p.name) if p.layer < len(layers) else None
        if param is None:
            places.append(ParamLocation(p.layer, p.name, p.placement, expected, Location.MISSING, ""))
            continue
        data = param.data
        ptr = _storage(data) if data.device.type != "meta" and data.numel() else 0
        if data.device.type == "meta":
            actual = Location.META
        elif ptr and ptr in slot_ptrs:
            actual = Location.SLOT
        elif ptr and ptr in view_ptrs:
            actual = Location.DEVICE_VIEW
        elif ptr and ptr in host_ptrs or data.device != device:
            actual = Location.HOST_PINNED if runtime.is_pinned(data) else Location.HOST_PAGEABLE
        else:
            actual = Location.DEVICE
        if kept_on_host(plan, p) and actual in (Location.HOST_PINNED, Location.HOST_PAGEABLE):
            expected = actual  # a host weight the plan keeps where it is (keep_host_params)
        if actual in (Location.DEVICE, Location.SLOT) and ptr:
            held[ptr] = data.untyped_storage().nbytes()
        places.append(ParamLocation(p.layer, p.name, p.placement, expected, actual, str(data.device)))
    for t in slots:
        if t.numel():
            held.setdefault(_storage(t), t.untyped_storage().nbytes())
    return LiveCheck(tuple(places), sum(held.values()), plan.device_bytes_resident + plan.device_bytes_buffers)


def render_check(check: LiveCheck) -> str:
    """`check` for people: the counts per place, the device bytes, every difference."""
    counts: dict[Location, int] = {}
    for p in check.params:
        counts[p.actual] = counts.get(p.actual, 0) + 1
    lines = [
        "live check: " + ("every planned parameter is where the plan says" if check.ok
                          else f"{len(check.differences)} of {len(check.params)} parameters differ from the plan"),
        "  places: " + (", ".join(f"{n} {place.value}" for place, n in counts.items()) or "no parameters"),
        f"  device bytes held: {check.device_bytes_held} (plan: {check.plan_device_bytes})",
    ]
    lines += [f"  layer {p.layer} {p.name}: planned {p.placement.value} ({p.expected.value}), is {p.actual.value}"
              + (f" on {p.device}" if p.device else "") for p in check.differences]
    return "\n".join(lines)
