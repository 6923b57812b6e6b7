"""The values of the expert cache: the plan of one layer's cache (`ExpertCachePlan`), a
routing profile (`RoutingProfile`: how often each expert ran) and a routing trace
(`RoutingTrace`: which experts ran, step by step)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, is_int, tuple_of
from offload.pure.spec.experts import ExpertGroup

__all__ = ["CachePolicy", "ExpertCachePlan", "RoutingProfile", "RoutingTrace", "served_refs"]


class CachePolicy(enum.Enum):
    """Which resident expert a miss evicts when the cache is full (`offload.pure.experts.policy`)."""

    LRU = "lru"  # the least recently routed
    LFU = "lfu"  # the least often routed (counts aged), then the least recently; a colder miss is not kept


def _experts_of(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(is_int(v) for v in value) or list(value) != sorted(set(value)):
        raise PlanError(f"{attribute.name} must be a sorted tuple of distinct expert indices, got {value!r}",
                        name=attribute.name, value=value)


@attrs.frozen(kw_only=True)
class ExpertCachePlan:
    """The device expert cache of one experts module.

    Its experts live in host memory (or on disk) with the layer's other offloaded weights;
    `slots` of them at a time also live in device slots and are served from there, the
    others are copied from host memory when routed.

    Attributes:
        group: the experts module (`ExpertGroup`).
        slots: C, device slots of one expert each (1 to E).
        held: experts loaded into their slots at post_init and never evicted (from a
            routing profile; sorted, distinct, fewer than or as many as `slots`).
        policy: which resident a miss evicts.
    """

    group: ExpertGroup = attrs.field(validator=attrs.validators.instance_of(ExpertGroup))
    slots: int = attrs.field(validator=int_at_least(1, PlanError))
    held: tuple[int, ...] = attrs.field(default=(), validator=_experts_of)
    policy: CachePolicy = attrs.field(default=CachePolicy.LFU, validator=attrs.validators.instance_of(CachePolicy))

    def __attrs_post_init__(self) -> None:
        e = self.group.num_experts
        where = f"expert cache of {self.group.layer}:{self.group.module}"
        if self.slots > e:
            raise PlanError(f"{where}: {self.slots} slots for {e} experts (1 to {e})", name="slots", value=self.slots)
        if len(self.held) > self.slots:
            raise PlanError(f"{where}: {len(self.held)} held experts for {self.slots} slots", name="held",
                            value=self.held)
        if self.held and (self.held[0] < 0 or self.held[-1] >= e):
            raise PlanError(f"{where}: held experts {self.held} not all in 0..{e - 1}", name="held", value=self.held)

    @property
    def layer(self) -> int:
        """The index of its layer."""
        return self.group.layer

    @property
    def device_bytes(self) -> int:
        """Device bytes of its slots: C x B."""
        return self.slots * self.group.expert_bytes


def served_refs(caches: Iterable[ExpertCachePlan]) -> frozenset[tuple[int, str]]:
    """The (layer, parameter name) of every parameter `caches` serve."""
    return frozenset((c.layer, name) for c in caches for name in c.group.params)


def _counts(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    tuple_of(tuple, PlanError)(instance, attribute, value)
    for entry in value:
        if (len(entry) != 3 or not is_int(entry[0]) or entry[0] < 0 or not isinstance(entry[1], str)
                or not isinstance(entry[2], tuple) or not all(is_int(c) and c >= 0 for c in entry[2])):
            raise PlanError(f"a profile entry is (layer, module, counts per expert >= 0), got {entry!r}",
                            name="counts", value=entry)
    keys = [(layer, module) for layer, module, _ in value]
    if len(set(keys)) != len(keys):
        raise PlanError(f"a profile names a module twice: {keys!r}", name="counts", value=keys)


@attrs.frozen(kw_only=True)
class RoutingProfile:
    """How often each expert was routed, per experts module: recorded from forwards
    (`offload.executors.experts.record_routing`) or read from JSON.

    Attributes:
        counts: one ``(layer, module, counts)`` per experts module, ``counts[j]`` the
            tokens routed to expert j.
    """

    counts: tuple[tuple[int, str, tuple[int, ...]], ...] = attrs.field(validator=_counts)


def _steps(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple):
        raise PlanError(f"steps must be a tuple, got {value!r}", name="steps", value=value)
    for step in value:
        if not isinstance(step, tuple) or len(step) != len(instance.groups):
            raise PlanError(f"each step names the routed experts of {len(instance.groups)} groups, got {step!r}",
                            name="steps", value=step)
        for group, routed in zip(instance.groups, step, strict=True):
            _experts_of(instance, attribute, routed)
            if routed and (routed[0] < 0 or routed[-1] >= group.num_experts):
                raise PlanError(f"routed experts {routed} of {group.layer}:{group.module} not all in "
                                f"0..{group.num_experts - 1}", name="steps", value=routed)


@attrs.frozen(kw_only=True)
class RoutingTrace:
    """Which experts ran, step by step: ``steps[t][g]`` the sorted distinct experts of
    `groups[g]` routed at step t (one call of each experts module per step).

    Attributes:
        groups: the experts modules, in the order each step lists them.
        steps: the routed experts per step and group.
    """

    groups: tuple[ExpertGroup, ...] = attrs.field(validator=tuple_of(ExpertGroup, PlanError))
    steps: tuple[tuple[tuple[int, ...], ...], ...] = attrs.field(validator=_steps)
