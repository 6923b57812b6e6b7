"""The expert caches as `fit`'s table sees them (`offload.pure.fit.table`): what each
layer's caches take of the device at the search's C, which buffer keys and bytes they
serve (`cache_costs`), and, with a routing trace, what they make the layer wait at its
experts' calls per step (`expert_waits`), as `estimate(..., routing=)` costs a plan's;
without one, the worst case of those waits (`bounded_waits`), as `estimate` costs it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from offload.pure.experts.expected import LayerLoad, bounded_loads, expected_loads
from offload.pure.experts.values import ExpertCachePlan, RoutingTrace
from offload.pure.fit.estimate import Workload, hit_seconds
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.spec.experts import ExpertGroup
from offload.pure.spec.values import ModelSpec

__all__ = ["CacheCosts", "Key", "bounded_waits", "cache_costs", "cache_waits", "expert_waits"]

#: Per layer, the wait at its experts' calls for its hits' copies from their slots
#: (seconds) and the bytes its caches copy from host memory (their misses', on average;
#: the simulation puts them on the link), per step; zero for a layer without a cache.
Waits = tuple[tuple[float, ...], tuple[float, ...]]

#: A prefetch buffer key, as `make_plan` keys buffers: (name, shape, stride, dtype).
Key = tuple[str, tuple[int, ...], tuple[int, ...], str]


@attrs.frozen(kw_only=True)
class CacheCosts:
    """The experts modules a prefetch plan would cache, and per layer what their caches
    take; every tuple empty when there are none.

    Attributes:
        groups: the modules cached where their layer is prefetched.
        device_bytes: per layer, their slots' bytes.
        keys: per layer, the buffer keys of the parameters they serve.
        served_bytes: per layer, those parameters' bytes.
    """

    groups: tuple[ExpertGroup, ...] = ()
    device_bytes: tuple[int, ...] = ()
    keys: tuple[frozenset[Key], ...] = ()
    served_bytes: tuple[int, ...] = ()


def cache_costs(spec: ModelSpec, owners: Mapping[tuple[int, str], Key], slots: int) -> CacheCosts:
    """The caches of `slots` slots of each experts module whose parameters all have buffers
    of their own when the layer is prefetched (`owners`; `plan_expert_caches`' rule:
    prefetched, untied)."""
    out = [0] * len(spec.layers)
    keys: list[set[Key]] = [set() for _ in spec.layers]
    served = [0] * len(spec.layers)
    groups = []
    for group in spec.experts:
        refs = [(group.layer, name) for name in group.params]
        if all(ref in owners for ref in refs):
            groups.append(group)
            out[group.layer] += slots * group.expert_bytes
            keys[group.layer].update(owners[ref] for ref in refs)
            sizes = {p.name: p.nbytes for p in spec.layers[group.layer].params}
            served[group.layer] += sum(sizes[name] for name in group.params)
    if not groups:
        return CacheCosts()
    return CacheCosts(groups=tuple(groups), device_bytes=tuple(out), keys=tuple(map(frozenset, keys)),
                      served_bytes=tuple(served))


def expert_waits(spec: ModelSpec, groups: tuple[ExpertGroup, ...], slots: int, routing: RoutingTrace,
                 profile: DeviceProfile) -> Waits:
    """Per layer, the wait at its experts' calls for its hits and the bytes its caches copy
    from host memory per step over `routing` (`Waits`), with `slots` slots each and the
    default policy, as `estimate` costs a plan's caches; zero for a layer without one.

    Raises:
        PlanError: `routing` lacks one of `groups`, names a module `spec` does not have,
            or has no steps (`offload.pure.experts.expected`).
    """
    plans = tuple(ExpertCachePlan(group=g, slots=slots) for g in groups)
    loads = expected_loads(plans, routing, {(layer.index, p.name) for layer in spec.layers for p in layer.params})
    return _waits(len(spec.layers), loads.layers, profile)


def bounded_waits(spec: ModelSpec, groups: tuple[ExpertGroup, ...], slots: int, tokens: tuple[int, ...],
                  profile: DeviceProfile) -> Waits:
    """`expert_waits` of the worst case (`offload.pure.experts.expected.bounded_loads`) at
    `tokens` per step of each layer."""
    loads = bounded_loads(tuple(ExpertCachePlan(group=g, slots=slots) for g in groups), tokens)
    return _waits(len(spec.layers), loads, profile)


def cache_waits(spec: ModelSpec, groups: tuple[ExpertGroup, ...], slots: int, routing: RoutingTrace | None,
                workload: Workload, profile: DeviceProfile) -> Waits:
    """The waits the table costs: over `routing` (`expert_waits`), else their worst case at
    `workload`'s tokens (`bounded_waits`); empty without `groups`."""
    if not groups:
        return (), ()
    if routing is not None:
        return expert_waits(spec, groups, slots, routing, profile)
    return bounded_waits(spec, groups, slots, workload.tokens_by_layer(spec.stack_ranges, len(spec.layers)), profile)


def _waits(num_layers: int, loads: Iterable[LayerLoad], profile: DeviceProfile) -> Waits:
    hits, moved = [0.0] * num_layers, [0.0] * num_layers
    for load in loads:
        hits[load.layer] = hit_seconds(load, profile)
        moved[load.layer] = load.miss_bytes
    return tuple(hits), tuple(moved)
