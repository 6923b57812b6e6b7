"""What a routing trace makes a plan's expert caches copy, per layer and step, on average
(`expected_loads`): the step estimate's input for MoE layers (`offload.pure.fit.estimate`).

The trace is replayed through the plan's caches (`replay`, which calls the executor's
policy), and beside it through Belady's optimum for the same slots (`belady`). A trace may
name experts modules the plan gives no cache (layers kept resident, or streamed whole):
they are left out, as their experts are not the caches' to copy. Every cache of the plan
must be in the trace, or its layer's step would be guessed.

Without a trace, the worst case a step can make its caches copy is bounded (`bounded_loads`):
a call over T tokens routes at most min(E, T x top_k) experts (`ExpertGroup.top_k`; all E
where the module does not say its top-k), and at most E minus its held experts miss.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs

from offload.errors import PlanError
from offload.pure.experts.replay import Replay, belady, replay
from offload.pure.experts.values import ExpertCachePlan, RoutingTrace

__all__ = ["ExpectedLoads", "LayerLoad", "bounded_loads", "expected_loads", "restrict_trace"]


@attrs.frozen(kw_only=True)
class LayerLoad:
    """One layer's expert caches over a trace, per step on average.

    Attributes:
        layer: the layer.
        miss_bytes: bytes copied from the host (misses x B), per step.
        hit_bytes: bytes of the experts served from slots (hits x B), per step; each is
            copied from its slot into its row on the device.
        routed: experts routed per step.
        hits: of those, served from a slot.
    """

    layer: int
    miss_bytes: float
    hit_bytes: float
    routed: float
    hits: float


@attrs.frozen(kw_only=True)
class ExpectedLoads:
    """A trace replayed through a plan's caches.

    Attributes:
        layers: one `LayerLoad` per layer with a cache, in layer order.
        steps: the steps of the trace.
        replayed: the replay through the plan's policy.
        optimum: Belady's optimum for the same slots and held experts.
    """

    layers: tuple[LayerLoad, ...]
    steps: int
    replayed: Replay
    optimum: Replay


def restrict_trace(trace: RoutingTrace, plans: tuple[ExpertCachePlan, ...],
                   params: Collection[tuple[int, str]] | None = None) -> RoutingTrace:
    """`trace` cut to the experts modules `plans` cache.

    Args:
        trace: the trace.
        plans: the caches.
        params: the (layer, parameter name) of every parameter of the model, where known:
            each module of the trace must have its parameters there (a trace of another
            model is refused, not cut).

    Raises:
        PlanError: `trace` is not a `RoutingTrace`; a cache's module is not in it (naming
            the module and those it has); a module of it is not the model's.
    """
    if not isinstance(trace, RoutingTrace):
        raise PlanError(f"routing must be a RoutingTrace, got {trace!r}", name="routing", value=trace)
    if params is not None:
        for group in trace.groups:
            missing = [name for name in group.params if (group.layer, name) not in params]
            if missing:
                raise PlanError(f"the routing trace's experts module {group.layer}:{group.module} is not this "
                                f"model's (its layer {group.layer} has no parameter {missing[0]})", name="routing",
                                value=(group.layer, group.module))
    named = [(g.layer, g.module) for g in trace.groups]
    for plan in plans:
        if (plan.layer, plan.group.module) not in named:
            raise PlanError(f"the routing trace has no steps of {plan.layer}:{plan.group.module}, which the plan "
                            f"caches (the trace has {', '.join(f'{a}:{b}' for a, b in named) or 'no module'})",
                            name="routing", value=(plan.layer, plan.group.module))
    cached = {(plan.layer, plan.group.module) for plan in plans}
    keep = [g for g, key in enumerate(named) if key in cached]
    return RoutingTrace(groups=tuple(trace.groups[g] for g in keep),
                        steps=tuple(tuple(step[g] for g in keep) for step in trace.steps))


def expected_loads(plans: tuple[ExpertCachePlan, ...], trace: RoutingTrace,
                   params: Collection[tuple[int, str]] | None = None) -> ExpectedLoads:
    """Each layer's expert copies per step when `plans` serve `trace`.

    Args:
        plans: the plan's expert caches (`OffloadPlan.experts`).
        trace: the routed experts per step (`RoutingTrace`), of at least one step; modules
            without a cache in `plans` are left out.
        params: the model's (layer, parameter name) pairs, where known (`restrict_trace`).

    Raises:
        PlanError: as `restrict_trace` says; the trace has no steps; a module of the trace has
            another expert count than its cache (`replay`).
    """
    cut = restrict_trace(trace, plans, params)
    if not cut.steps:
        raise PlanError("the routing trace has no steps: it predicts nothing", name="routing", value=0)
    replayed = replay(plans, cut)
    steps = len(cut.steps)
    by_layer: dict[int, list[float]] = {}
    for g in replayed.groups:
        row = by_layer.setdefault(g.layer, [0.0, 0.0, 0.0, 0.0])
        row[0] += g.miss_bytes
        row[1] += g.hits * g.expert_bytes
        row[2] += g.routed
        row[3] += g.hits
    layers = tuple(
        LayerLoad(layer=layer, miss_bytes=row[0] / steps, hit_bytes=row[1] / steps, routed=row[2] / steps,
                  hits=row[3] / steps)
        for layer, row in sorted(by_layer.items()))
    return ExpectedLoads(layers=layers, steps=steps, replayed=replayed, optimum=belady(plans, cut))


def bounded_loads(plans: tuple[ExpertCachePlan, ...], tokens: Sequence[int]) -> tuple[LayerLoad, ...]:
    """The most each layer's expert caches can copy in one step.

    A call over T tokens routes at most R = min(E, T x top_k) experts (R = E where the
    module does not say its top-k: every expert may be routed); the worst case is that as
    many of them as can miss do: min(E - held, R) misses, the rest of the R hits (held
    experts). The misses are the bytes that cross the link; a hit's copy from its slot
    costs far less. (A module of `Routing.CALLS` is assumed to call only the experts it
    routes tokens to.)

    Args:
        plans: the plan's expert caches (`OffloadPlan.experts`).
        tokens: tokens per step of each layer (`Workload.tokens_by_layer`), indexed by layer.
    """
    by_layer: dict[int, list[float]] = {}
    for plan in plans:
        group = plan.group
        top_k = group.top_k or group.num_experts
        routed = min(group.num_experts, tokens[plan.layer] * top_k)
        misses = min(group.num_experts - len(plan.held), routed)
        row = by_layer.setdefault(plan.layer, [0.0, 0.0, 0.0, 0.0])
        row[0] += misses * group.expert_bytes
        row[1] += (routed - misses) * group.expert_bytes
        row[2] += routed
        row[3] += routed - misses
    return tuple(LayerLoad(layer=layer, miss_bytes=row[0], hit_bytes=row[1], routed=row[2], hits=row[3])
                 for layer, row in sorted(by_layer.items()))
