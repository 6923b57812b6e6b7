"""The expert caches of a plan (`plan_expert_caches`): one per experts module
(`ModelSpec.experts`) whose layer the plan prefetches, with every parameter of the module
prefetched and untied; `OffloadConfig.expert_slots` slots each, or the default, holding
the routing profile's hottest experts for good where the config gives one."""

from __future__ import annotations

from collections.abc import Sequence

from offload.pure.config import OffloadConfig
from offload.pure.experts.profile import check_profile, held_from_profile
from offload.pure.experts.size import check_slots, default_slots
from offload.pure.experts.values import ExpertCachePlan
from offload.pure.plan.values import ParamPlan, serves_cache
from offload.pure.spec.values import ModelSpec

__all__ = ["plan_expert_caches"]


def plan_expert_caches(spec: ModelSpec, config: OffloadConfig, params: Sequence[ParamPlan]
                       ) -> tuple[ExpertCachePlan, ...]:
    """The expert caches for `spec` planned as `params` under `config`.

    A routing profile holds each cache's hottest experts (those it counts, up to half of
    the slots, so that the others still serve the misses).

    Raises:
        PlanError: ``config.expert_slots`` is above an experts module's expert count
            (naming the layer and its count), or ``config.routing_profile`` is not of this
            model's experts modules (naming the mismatch).
    """
    if not config.expert_cache or not spec.experts:
        return ()
    if config.expert_slots is not None:
        check_slots(spec.experts, config.expert_slots)
    if config.routing_profile is not None:
        check_profile(config.routing_profile, spec.experts)
    layers = {g.layer for g in spec.experts}
    by_ref = {(p.layer, p.name): p for p in params if p.layer in layers}
    caches: list[ExpertCachePlan] = []
    for group in spec.experts:
        if not all(serves_cache(group, by_ref.get((group.layer, name))) for name in group.params):
            continue
        slots = config.expert_slots if config.expert_slots is not None else default_slots(group)
        profile = config.routing_profile
        held = held_from_profile(profile, group, slots // 2) if profile is not None else ()
        caches.append(ExpertCachePlan(group=group, slots=slots, held=held))
    return tuple(caches)
