"""Replaying a routing trace through the expert caches: what the policy hits and copies
(`replay`), what the best possible cache would (`belady`), and Zipf traces to replay
(`zipf_trace`).

`replay` calls `offload.pure.experts.policy.admit` exactly as the executor does, so its
hits, misses and bytes are the executor's. `belady` is the offline optimum for the same
slots and held experts: after each call a cache may keep any C of the experts it held or
was routed (a miss may bypass, a hit may be dropped), and it keeps those routed again
soonest (Belady's MIN, which is optimal for this model: the tests hold it equal to an
exhaustive search). No online policy does better; on traces whose calls are independent
draws (Zipf) none does better in expectation than keeping the C most popular experts,
which is below Belady by as much as the future tells.

A step of a `Routing.CALLS` module (a ``ModuleList`` of experts) is one call of the cache
per routed expert, in index order (`calls_of`), in both.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random

import attrs

from offload.errors import PlanError
from offload.pure._checks import check_int_at_least, is_int
from offload.pure.experts.policy import admit, initial_state
from offload.pure.experts.values import ExpertCachePlan, RoutingTrace
from offload.pure.spec.experts import ExpertGroup

__all__ = ["BELADY", "GroupReplay", "Replay", "belady", "calls_of", "replay", "zipf_trace"]

#: `GroupReplay.policy` of a `belady` result.
BELADY = "belady"


@attrs.frozen(kw_only=True)
class GroupReplay:
    """The totals of one expert cache over a trace.

    Attributes:
        layer: its layer.
        module: its experts module.
        policy: the `CachePolicy` value it ran (``"lfu"``, ``"lru"``), or `BELADY`.
        routed: routed experts over all calls (each call counts each expert once).
        hits: those served from a slot.
        misses: those copied from the host (``routed - hits``).
        evictions: residents dropped to make room.
        expert_bytes: B, bytes of one expert.
    """

    layer: int
    module: str
    policy: str
    routed: int
    hits: int
    misses: int
    evictions: int
    expert_bytes: int

    @property
    def hit_rate(self) -> float:
        """hits / routed, from 0 to 1; 1.0 when nothing was routed (nothing was missed)."""
        return self.hits / self.routed if self.routed else 1.0

    @property
    def miss_bytes(self) -> int:
        """Bytes copied from the host: misses x B."""
        return self.misses * self.expert_bytes


@attrs.frozen(kw_only=True)
class Replay:
    """A trace replayed through the expert caches of a model.

    Attributes:
        groups: one `GroupReplay` per experts module of the trace, in its order.
        step_bytes: per step, the expert bytes copied from the host to the device over
            all groups (each group's misses x its B).
    """

    groups: tuple[GroupReplay, ...]
    step_bytes: tuple[int, ...]

    @property
    def routed(self) -> int:
        """Routed experts over all groups and calls."""
        return sum(g.routed for g in self.groups)

    @property
    def hits(self) -> int:
        """Hits over all groups."""
        return sum(g.hits for g in self.groups)

    @property
    def misses(self) -> int:
        """Misses over all groups."""
        return sum(g.misses for g in self.groups)

    @property
    def hit_rate(self) -> float:
        """hits / routed over all groups, from 0 to 1; 1.0 when nothing was routed."""
        routed = self.routed
        return self.hits / routed if routed else 1.0

    @property
    def total_bytes(self) -> int:
        """Expert bytes copied from the host over the trace."""
        return sum(self.step_bytes)

    @property
    def mean_step_bytes(self) -> float:
        """Expert bytes copied from the host per step, on average (0.0 for no steps)."""
        return self.total_bytes / len(self.step_bytes) if self.step_bytes else 0.0


def _plans_for(plans: tuple[ExpertCachePlan, ...], trace: RoutingTrace) -> tuple[ExpertCachePlan, ...]:
    """The plan of each of the trace's groups, in the trace's order."""
    if not isinstance(trace, RoutingTrace):
        raise PlanError(f"trace must be a RoutingTrace, got {trace!r}", name="trace", value=trace)
    by_key: dict[tuple[int, str], ExpertCachePlan] = {}
    for plan in plans:
        if not isinstance(plan, ExpertCachePlan):
            raise PlanError(f"plans must be ExpertCachePlans, got {plan!r}", name="plans", value=plan)
        key = (plan.group.layer, plan.group.module)
        if key in by_key:
            raise PlanError(f"two expert cache plans for {key[0]}:{key[1]}", name="plans", value=key)
        by_key[key] = plan
    chosen = []
    for group in trace.groups:
        found = by_key.get((group.layer, group.module))
        if found is None:
            raise PlanError(f"the trace's experts module {group.layer}:{group.module} has no expert cache plan "
                            f"(plans for {sorted(by_key)})", name="trace", value=(group.layer, group.module))
        if found.group.num_experts != group.num_experts:
            raise PlanError(f"the trace's experts module {group.layer}:{group.module} has {group.num_experts} "
                            f"experts, its plan {found.group.num_experts}", name="num_experts",
                            value=group.num_experts)
        chosen.append(found)
    return tuple(chosen)


def calls_of(group: ExpertGroup, routed: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The cache's calls for one step's routed experts of `group`: one call of them all,
    or, for a `Routing.CALLS` module, one per expert in index order, as a parent's loop
    over its experts calls them (and as the executor then admits them)."""
    return [routed] if group.fused else [(expert,) for expert in routed]


def replay(plans: tuple[ExpertCachePlan, ...], trace: RoutingTrace) -> Replay:
    """Run every step of `trace` through the caches of `plans`, as the executor would.

    Args:
        plans: the expert caches (plans for modules the trace does not name are unused).
        trace: the routed experts per step and group.

    Returns:
        Each group's totals and the bytes copied from the host per step.

    Raises:
        PlanError: a group of the trace has no plan (matched by layer and module), or a
            different E; or two plans are for one module.
    """
    chosen = _plans_for(plans, trace)
    states = [initial_state(plan) for plan in chosen]
    totals = [[0, 0, 0] for _ in chosen]  # hits, misses, evictions
    step_bytes = []
    for step in trace.steps:
        nbytes = 0
        for g, (plan, routed) in enumerate(zip(chosen, step, strict=True)):
            for call in calls_of(plan.group, routed):
                access = admit(plan, states[g], call)
                states[g] = access.state
                totals[g][0] += len(access.hits)
                totals[g][1] += len(access.misses)
                totals[g][2] += len(access.evicted)
                nbytes += len(access.misses) * plan.group.expert_bytes
        step_bytes.append(nbytes)
    groups = tuple(
        GroupReplay(layer=plan.group.layer, module=plan.group.module, policy=plan.policy.value,
                    routed=hits + misses, hits=hits, misses=misses, evictions=evictions,
                    expert_bytes=plan.group.expert_bytes)
        for plan, (hits, misses, evictions) in zip(chosen, totals, strict=True))
    return Replay(groups=groups, step_bytes=tuple(step_bytes))


def _belady_group(plan: ExpertCachePlan, calls: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Belady's MIN for one cache: the misses of each call and the evictions."""
    never = len(calls)
    held = frozenset(plan.held)
    room = plan.slots - len(held)
    # upcoming[t][i]: the next call after t that routes calls[t][i] (`never`: none).
    upcoming: list[list[int]] = [[] for _ in calls]
    seen: dict[int, int] = {}
    for t in range(len(calls) - 1, -1, -1):
        upcoming[t] = [seen.get(expert, never) for expert in calls[t]]
        for expert in calls[t]:
            seen[expert] = t
    cached: dict[int, int] = {}  # expert -> the next call that routes it
    misses = []
    evictions = 0
    for t, routed in enumerate(calls):
        missed = 0
        before = set(cached)
        for expert, following in zip(routed, upcoming[t], strict=True):
            if expert in held:
                continue
            if expert not in cached:
                missed += 1
            cached[expert] = following
        misses.append(missed)
        if len(cached) > room:
            keep = heapq.nsmallest(room, cached.items(), key=lambda item: (item[1], item[0]))
            cached = dict(keep)
            evictions += sum(1 for expert in before if expert not in cached)
    return misses, evictions


def belady(plans: tuple[ExpertCachePlan, ...], trace: RoutingTrace) -> Replay:
    """The most hits any cache of the same slots and held experts could have on `trace`.

    After each call, the cache keeps, of the experts it held or the call routed, the C - h
    (h held) that are routed again soonest, besides the held ones. This is optimal among
    all caches that may drop any resident and keep any routed expert after each call (a
    superset of what `admit` allows), so it bounds every policy's hits from above.

    Args:
        plans: the expert caches (slots and held experts; the policy is not used).
        trace: the routed experts per step and group.

    Returns:
        A `Replay` of the optimum, each group's `policy` `BELADY`; its evictions count the
        residents dropped that the dropping call did not route (bypassed misses are not
        evictions).

    Raises:
        PlanError: as `replay`.
    """
    chosen = _plans_for(plans, trace)
    per_group = []
    for g, plan in enumerate(chosen):
        calls = [calls_of(plan.group, step[g]) for step in trace.steps]
        misses, evictions = _belady_group(plan, [call for step in calls for call in step])
        # Back to steps: each step's calls are consecutive.
        ends = list(itertools.accumulate(len(step) for step in calls))
        per_group.append(([sum(misses[end - len(step):end]) for end, step in zip(ends, calls, strict=True)],
                          evictions))
    groups = []
    for g, (plan, (misses, evictions)) in enumerate(zip(chosen, per_group, strict=True)):
        routed = sum(len(step[g]) for step in trace.steps)
        missed = sum(misses)
        groups.append(GroupReplay(layer=plan.group.layer, module=plan.group.module, policy=BELADY, routed=routed,
                                  hits=routed - missed, misses=missed, evictions=evictions,
                                  expert_bytes=plan.group.expert_bytes))
    step_bytes = tuple(
        sum(misses[t] * plan.group.expert_bytes for plan, (misses, _) in zip(chosen, per_group, strict=True))
        for t in range(len(trace.steps)))
    return Replay(groups=tuple(groups), step_bytes=step_bytes)


def _check_zipf_arguments(groups: object, steps: object, top_k: object, tokens: object, s: object,
                          seed: object) -> None:
    if not isinstance(groups, tuple) or not all(isinstance(g, ExpertGroup) for g in groups):
        raise PlanError(f"groups must be a tuple of ExpertGroups, got {groups!r}", name="groups", value=groups)
    check_int_at_least("steps", steps, 0, PlanError)
    check_int_at_least("top_k", top_k, 1, PlanError)
    check_int_at_least("tokens", tokens, 1, PlanError)
    if not is_int(seed):
        raise PlanError(f"seed must be an integer, got {seed!r}", name="seed", value=seed)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        raise PlanError(f"s must be a finite number >= 0, got {s!r}", name="s", value=s)


def zipf_trace(groups: tuple[ExpertGroup, ...], *, steps: int, top_k: int, tokens: int = 1, s: float = 1.0,
               seed: int = 0) -> RoutingTrace:
    """A pseudo-random trace whose calls are independent Zipf draws.

    In each group, the expert of popularity rank r (from 1) has weight ``r ** -s``, and
    the ranks are a random permutation of the experts, drawn per group. At each step
    each of `tokens` tokens picks `top_k` distinct experts, one after another in
    proportion to the weights of those not yet picked (drawn by Efraimidis and Spirakis'
    keys, which is the same distribution); a step routes the union over its tokens.

    Args:
        groups: the experts modules (each with at least `top_k` experts).
        steps: the calls of each module (>= 0).
        top_k: experts per token (>= 1).
        tokens: tokens per call (>= 1): 1 for decoding one sequence, the batch size for
            a batch.
        s: the Zipf exponent (a finite number >= 0; 0 is uniform).
        seed: the seed; the same arguments always give the same trace (`random.Random`,
            seeded explicitly, is deterministic across platforms).

    Raises:
        PlanError: an argument outside the ranges above, naming it.
    """
    _check_zipf_arguments(groups, steps, top_k, tokens, s, seed)
    for group in groups:
        if top_k > group.num_experts:
            raise PlanError(f"top_k of {top_k} is more than the {group.num_experts} experts of "
                            f"{group.layer}:{group.module}", name="top_k", value=top_k)
    rng = random.Random(seed)
    weights = []
    for group in groups:
        ranks = list(range(group.num_experts))
        rng.shuffle(ranks)  # ranks[expert]: its popularity rank, from 0
        weights.append([float(rank + 1) ** -s for rank in ranks])
    trace = []
    for _ in range(steps):
        step = []
        for weight in weights:
            routed: set[int] = set()
            for _ in range(tokens):
                # Efraimidis-Spirakis: the top_k largest log(u) / w are a weighted draw without replacement.
                keys = [math.log(1.0 - rng.random()) / w for w in weight]
                routed.update(heapq.nlargest(top_k, range(len(keys)), key=keys.__getitem__))
            step.append(tuple(sorted(routed)))
        trace.append(tuple(step))
    return RoutingTrace(groups=groups, steps=tuple(trace))
