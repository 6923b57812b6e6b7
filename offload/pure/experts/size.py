"""How many device slots the expert caches get: the most a device budget allows
(`cache_slots`), the default of a module when neither a budget nor a number is given
(`default_slots`), and the check of a number the user gave (`check_slots`).

A budget or a user's number gives one C to every experts module of a model (each MoE
layer has C slots), so the caches' device bytes are C x the sum of the modules' B, and C
runs from 1 to the smallest E.
"""

from __future__ import annotations

from offload.errors import PlanError
from offload.pure._checks import check_int_at_least, is_int
from offload.pure.spec.experts import ExpertGroup
from offload.pure.units import format_bytes

__all__ = ["DEFAULT_FRACTION", "cache_slots", "check_slots", "default_slots"]

#: Without a budget, each cache holds 1 / DEFAULT_FRACTION of its experts (E 64: 8 slots,
#: enough for one token's top-8 at decode; E 8: 1 slot).
DEFAULT_FRACTION = 8


def _check_groups(groups: object) -> tuple[ExpertGroup, ...]:
    if not isinstance(groups, tuple) or not groups or not all(isinstance(g, ExpertGroup) for g in groups):
        raise PlanError(f"groups must be a non-empty tuple of ExpertGroups, got {groups!r}", name="groups",
                        value=groups)
    return groups


def cache_slots(groups: tuple[ExpertGroup, ...], spare_device_bytes: int) -> int:
    """The largest C whose caches fit `spare_device_bytes`.

    Args:
        groups: the model's experts modules (at least one).
        spare_device_bytes: device bytes the caches may take (>= 0).

    Returns:
        The largest C from 1 to min E with C x sum(B) <= `spare_device_bytes`.

    Raises:
        PlanError: `groups` is empty, or `spare_device_bytes` is not an int >= 0, or even
            one slot per module does not fit: the message gives the bytes one slot each
            takes (sum of B) and the spare bytes given.
    """
    groups = _check_groups(groups)
    check_int_at_least("spare_device_bytes", spare_device_bytes, 0, PlanError)
    per_slot = sum(g.expert_bytes for g in groups)
    most = min(g.num_experts for g in groups)
    if per_slot > spare_device_bytes:
        raise PlanError(f"the expert caches need at least {per_slot} bytes ({format_bytes(per_slot)}: one slot "
                        f"for each of {len(groups)} experts modules), but {spare_device_bytes} bytes "
                        f"({format_bytes(spare_device_bytes)}) are spare on the device",
                        name="spare_device_bytes", value=spare_device_bytes)
    return min(most, spare_device_bytes // per_slot)


def default_slots(group: ExpertGroup) -> int:
    """C of a module when no budget or number is given: max(1, E // `DEFAULT_FRACTION`).

    The cache then takes about an eighth of the module's expert bytes on the device; where
    that is too much, give a budget (`cache_slots`) or a C.

    Raises:
        PlanError: `group` is not an `ExpertGroup`.
    """
    given: object = group
    if not isinstance(given, ExpertGroup):
        raise PlanError(f"group must be an ExpertGroup, got {given!r}", name="group", value=given)
    return max(1, group.num_experts // DEFAULT_FRACTION)


def check_slots(groups: tuple[ExpertGroup, ...], slots: int) -> None:
    """Raise `PlanError` unless `slots` (C, the user's) suits every module: 1 <= C <= E.

    Raises:
        PlanError: C is not an integer, is below 1, or is above the E of a module (the
            message names the first such module, its layer and its E).
    """
    groups = _check_groups(groups)
    if not is_int(slots):
        raise PlanError(f"expert cache slots must be an integer from 1, got {slots!r}", name="slots", value=slots)
    if slots < 1:
        raise PlanError(f"expert cache slots must be at least 1, got {slots}: a cache of no slot holds no "
                        "expert", name="slots", value=slots)
    for group in groups:
        if slots > group.num_experts:
            raise PlanError(f"expert_slots (C) {slots} is more than the {group.num_experts} experts of "
                            f"layer {group.layer} ({group.module}): C must be 1 to {group.num_experts}",
                            name="slots", value=slots)
