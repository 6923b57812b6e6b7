"""`check()`: where every planned parameter really is, against where the plan says.

"Is offloading even on?" is answered by looking at the live model, not at the plan: each
planned parameter is found by name and classified by what its data is (a static slot
buffer, a zero-copy view of a host copy, a host copy pinned or pageable, other device
memory, meta, or gone). The answer is a value (`offload.pure.check.LiveCheck`); a
difference from the plan is listed, never fixed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from offload.executors.common import find_parameter
from offload.protocols import Runtime
from offload.pure.check import FileCheck, LiveCheck, Location, ParamLocation, expected_place, kept_on_host
from offload.pure.plan.plan import OffloadPlan

__all__ = ["inspect_params"]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def inspect_params(plan: OffloadPlan, layers: Sequence[nn.Module], runtime: Runtime, *, ready: bool,
                   slots: Collection[torch.Tensor] = (), views: Collection[torch.Tensor] = (),
                   hosts: Collection[torch.Tensor] = (), on_disk: Collection[tuple[int, str]] = (),
                   in_files: Collection[torch.Tensor] = (), files: tuple[FileCheck, ...] = ()) -> LiveCheck:
    """Classify every planned parameter of `layers`.

    Args:
        plan: the plan being run.
        layers: the wrapped layers.
        runtime: the runtime (its device and its notion of pinned).
        ready: post_init has run.
        slots: the static buffers (prefetch).
        views: the zero-copy device views made (UVA).
        hosts: the host copies held.
        on_disk: the disk tier's parameters (expected in their files before post_init).
        in_files: the host copies that are private mappings of files (the disk tier's).
        files: the disk tier's files, each against the plan.
    """
    slot_ptrs = {_storage(t) for t in slots if t.numel()}
    view_ptrs = {_storage(t) for t in views if t.numel()}
    host_ptrs = {_storage(t) for t in hosts if t.numel()}
    file_ptrs = {_storage(t) for t in in_files if t.numel()}
    disk = set(on_disk)
    device = runtime.device
    held: dict[int, int] = {}
    places: list[ParamLocation] = []
    for p in plan.params:
        expected = expected_place(plan, p.placement, ready=ready)
        if not ready and (p.layer, p.name) in disk:
            expected = Location.DISK
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
        elif ptr and ptr in file_ptrs:
            actual = Location.DISK
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
    return LiveCheck(tuple(places), sum(held.values()), plan.device_bytes_resident + plan.device_bytes_buffers,
                     disk_params=tuple(sorted(disk)), files=files)
