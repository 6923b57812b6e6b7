"""`fit`: the fastest offloading configuration whose device memory fits a budget.

Candidates: backend none (all weights resident); prefetch over group size, number in
group and prefetch depth; UVA over byte budgets. A candidate's device bytes are its
resident weights + static buffers + the largest layer copied on demand (UVA without
zero-copy views) + the weights outside the layers (embeddings, head, final norm: the
caller's `outside_bytes`, always resident) + the caller's reserve; its time is
`estimate`'s steady-state step.

Plans are made against `planning_env(env, profile)`: on a machine without CUDA that is a
CUDA platform describing the profile's device, because `make_plan` frees no device memory
when the compute device is the CPU.

The search, and how it is kept fast (a 126-layer model well under a second, where one
`make_plan` alone takes milliseconds). Only the chosen configuration gets a real plan;
the others are predicted from a per-layer table of the model (`offload.pure.fit.table`)
that reproduces the planner's selection, buffers and byte totals (tests hold the two
equal), with the same step simulation `estimate` uses (`offload.pure.fit.candidates`).

1. None: if every resident weight plus the outside bytes and the reserve fits, it wins outright (no plan with
   offloading is faster than resident compute) and nothing else is searched.
2. UVA: time grows and device bytes shrink with the bytes offloaded, so only the smallest
   fitting prefix of parameters (in layer order) is a candidate.
3. Prefetch: group sizes 1..layers (a larger size repeats a tail run) and 1..size layers
   per group; pairs that offload the same layers are merged (the smallest size wins).
   For each set of layers a lower bound on its step, max(resident compute, copy bytes
   per step / link rate), and its fewest device bytes (depth 1) come from prefix sums;
   the copy bytes per step leave out the most that a depth which may fit keeps alone in
   a slot (such layers are loaded once, `offload.pure.plan.schedule`, but each slot holds a
   whole layer). Sets that cannot fit are dropped; the rest are simulated in order of
   that bound and skipped once the bound cannot beat the last runner-up. Depths
   1..min(positions, max_prefetch_step) are simulated upward, stopping at the first that
   reaches the bound.

Ranking: least predicted step (equal within a relative 1e-9), then fewer host bytes, then
fewer device bytes, then none < prefetch < uva, then smaller group size, number in group,
depth and UVA budget. Equal inputs give equal results.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import attrs

from offload.errors import ConfigError, PlanError
from offload.pure._checks import check_int_at_least
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.size import check_slots, default_slots
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.candidates import (
    BACKEND_ORDER,
    FitCandidate,
    best_depth,
    close,
    compare,
    describe,
    none_candidate,
    prefetch_candidate,
    same_outcome,
    tie_key,
    uva_candidates,
)
from offload.pure.fit.estimate import StepEstimate, Workload, estimate
from offload.pure.fit.host import HostTier
from offload.pure.fit.profiles import DeviceProfile, planning_env
from offload.pure.fit.refusal import Refusal, host_bounds
from offload.pure.fit.table import Table, buffer_bytes, build_table, expand, layer_sets
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import OffloadPlan
from offload.pure.serialize import to_data
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

__all__ = [
    "DEFAULT_MAX_PREFETCH_STEP",
    "DEFAULT_RESERVE_BYTES",
    "DEFAULT_RUNNERS_UP",
    "FitCandidate",
    "FitResult",
    "fit",
]

#: Device bytes set aside for everything that is not a weight, unless the caller says.
DEFAULT_RESERVE_BYTES = 0
#: The deepest prefetch searched: deeper ones rarely help and cost a buffer slot each.
DEFAULT_MAX_PREFETCH_STEP = 16
#: How many runners-up a result lists.
DEFAULT_RUNNERS_UP = 3

@attrs.frozen(kw_only=True)
class FitResult:
    """What `fit` chose, and why.

    Attributes:
        budget_bytes: the device budget, bytes.
        chosen: the winning candidate (its figures are those of `plan` and `estimate`).
        plan: the winning plan, made against `env`.
        estimate: its predicted step.
        runners_up: the next best candidates that fit, best first, one per outcome (step,
            host bytes, device bytes); none when backend none fits.
        profile: the device profile used.
        workload: the workload used.
        env: the snapshot the plan was made against (see `planning_env`).
        simulated: candidates whose step was simulated.
        considered: distinct candidates the search looked at.
        host_budget_bytes: the host budget the search held to (None: host memory was not
            limited); the plan's disk tier, if it needs one, is `plan_disk_tier` of `plan`
            for it (`offload.pure.disk.search.fit_with_tier` returns both).
    """

    budget_bytes: int
    chosen: FitCandidate
    plan: OffloadPlan
    estimate: StepEstimate
    runners_up: tuple[FitCandidate, ...]
    profile: DeviceProfile
    workload: Workload
    env: EnvSnapshot
    simulated: int
    considered: int
    host_budget_bytes: int | None = None

    def to_json(self, *, indent: int | None = None) -> str:
        """The whole result as JSON (values as `offload.pure.serialize.to_data` lays them out)."""
        return json.dumps(to_data(self), indent=indent)
def fit(
    spec: ModelSpec,
    env: EnvSnapshot,
    profile: DeviceProfile,
    workload: Workload,
    device_budget_bytes: int,
    *,
    outside_bytes: int = 0,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    param_filter: Sequence[str] = (),
    max_prefetch_step: int = DEFAULT_MAX_PREFETCH_STEP,
    runners_up: int = DEFAULT_RUNNERS_UP,
    host: HostTier | None = None,
    expert_cache: bool = True,
    expert_slots: int | None = None,
    routing: RoutingTrace | None = None,
) -> FitResult:
    """The configuration with the least predicted step time that fits the budget.

    A mixture-of-experts model's prefetched experts modules get expert caches
    (`OffloadConfig.expert_cache`), device memory the search counts: at `expert_slots`
    slots each, or, where that is None, at one slot each, after which the winner's caches
    take their default slots (`offload.pure.experts.size.default_slots`) if the budget
    has room for them, or else the largest C that fits (its config then says C; the
    runners-up keep one slot). With `routing` the step is costed as `estimate(...,
    routing=)` costs it: each offloaded MoE layer waits at its experts' calls for the misses
    and hits the trace gives its caches at the search's C (after reading the misses from
    the files, for a layer on the disk tier), and the winner, once its caches are sized, is
    estimated again at its own C (its figures, not the runners-up's, then count the larger
    caches). Without it, the same waits for their worst case (at most min(E, T x top_k)
    misses a call, all E where a module does not say its top-k:
    `offload.pure.experts.expected.bounded_loads`), as `estimate` costs it. The search is
    run with the caches and without (MoE layers streamed whole, their experts' copy
    overlapping the layers before them), and the faster wins, with its runners-up;
    `expert_cache=False` searches without only.

    Args:
        spec: the model.
        env: the user's switches and this machine (`planning_env` says what is used).
        profile: the target device's rates.
        workload: tokens per step, or a measured resident step time.
        device_budget_bytes: device bytes that resident weights, static buffers, on-demand
            copies, the weights outside the layers and the reserve may take together.
        outside_bytes: device bytes of weights outside the layers (embeddings, output
            head, final norm), always resident; `spec` does not hold them
            (`CheckpointSpec.outside_bytes`, `preset_outside_bytes`).
        reserve_bytes: device bytes kept for everything else (activations, caches).
        param_filter: dotted name segments; only matching parameters are offloaded.
        max_prefetch_step: the deepest prefetch searched (>= 1).
        runners_up: how many runners-up to return (>= 0).
        host: a host budget to hold to, and the disk tier that meets it
            (`offload.pure.disk.search.TierSearch`; see `offload.pure.fit.host`): a
            candidate whose host copies do not fit is costed with its last offloaded layers
            read from disk, or dropped where no disk tier makes it fit.
        expert_cache: False: no expert caches; MoE layers are streamed whole.
        expert_slots: C of every expert cache (1 to the smallest expert count); None: as
            the budget allows (above).
        routing: the routed experts per step (`RoutingTrace`); None: the worst case
            (above).

    Returns:
        The chosen configuration with its plan and estimate, and the runners-up.

    Raises:
        ConfigError: a negative budget, outside bytes or reserve, a bad filter segment, a
            bad limit, a bad `expert_cache` or `expert_slots`.
        PlanError: nothing fits; the message names the leanest configuration, the device
            bytes it needs and by how many bytes it misses the budget. With `host`: some
            configuration fits the device but none fits both budgets; the message names
            the least host budget that works with this device budget and the least device
            budget that works with this host budget, each with its configuration.
            `expert_slots` above an experts module's expert count (naming it). A `routing`
            trace that lacks an experts module that may be cached, names one the model does
            not have, or has no steps.
    """
    search = functools.partial(_fit, spec, env, profile, workload, device_budget_bytes, outside_bytes=outside_bytes,
                               reserve_bytes=reserve_bytes, param_filter=param_filter,
                               max_prefetch_step=max_prefetch_step, runners_up=runners_up, host=host,
                               expert_slots=expert_slots, routing=routing)
    if not expert_cache or not spec.experts:
        return search(expert_cache=expert_cache)
    # A layer waits for its misses at its experts' call, where streamed whole its experts'
    # copy overlaps the layers before it: either may be faster.
    refused: Refusal | None = None
    try:
        cached: FitResult | None = search(expert_cache=True)
    except Refusal as exc:
        cached, refused = None, exc  # nothing with the caches fits the budgets; streaming whole may
    try:
        whole = search(expert_cache=False, expert_slots=None)  # no caches, no C
    except Refusal as exc:
        if cached is not None:
            return cached
        # Neither fits. Where some configuration of either fits the device, the refusal
        # is for the host budget, naming the least budgets over both searches.
        if refused is not None and refused.bounds is not None and exc.bounds is not None \
                and "host_budget_bytes" in (refused.name, exc.name):
            raise refused.bounds.joined(exc.bounds).refusal() from None
        raise
    return cached if cached is not None and compare(cached.chosen, whole.chosen) <= 0 else whole


def _fit(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, workload: Workload, device_budget_bytes: int,
         *, outside_bytes: int, reserve_bytes: int, param_filter: Sequence[str], max_prefetch_step: int,
         runners_up: int, host: HostTier | None, expert_cache: bool, expert_slots: int | None,
         routing: RoutingTrace | None) -> FitResult:
    """`fit` with the expert caches on or off as `expert_cache` says."""
    check_int_at_least("device_budget_bytes", device_budget_bytes, 0, ConfigError)
    check_int_at_least("outside_bytes", outside_bytes, 0, ConfigError)
    check_int_at_least("reserve_bytes", reserve_bytes, 0, ConfigError)
    check_int_at_least("max_prefetch_step", max_prefetch_step, 1, ConfigError)
    check_int_at_least("runners_up", runners_up, 0, ConfigError)
    budget, reserve, max_step, keep = device_budget_bytes, reserve_bytes, max_prefetch_step, runners_up
    # Validates the segments and the expert options.
    segments = OffloadConfig(param_filter=tuple(param_filter), expert_cache=expert_cache,
                             expert_slots=expert_slots).param_filter
    if expert_cache and expert_slots is not None and spec.experts:
        check_slots(spec.experts, expert_slots)
    penv = planning_env(env, profile)
    table = build_table(spec, penv, profile, workload, segments, reserve, outside_bytes, expert_cache=expert_cache,
                        expert_slots=expert_slots, routing=routing)

    none = none_candidate(table)
    if none.device_bytes <= budget:
        return _result(spec, penv, table, budget, none, (), simulated=0, considered=1, host=host, routing=routing)

    top: list[FitCandidate] = []
    rank = functools.cmp_to_key(compare)

    def offer(candidate: FitCandidate) -> None:
        # Keep one candidate per outcome (step, host bytes, device bytes): runners-up that
        # differ only in which layers they offload tell the user nothing.
        same = next((c for c in top if same_outcome(c, candidate)), None)
        if same is not None and compare(candidate, same) >= 0:
            return
        top[:] = sorted([c for c in top if c is not same] + [candidate], key=rank)[:keep + 1]

    uva, uva_leanest = uva_candidates(table, budget)
    leanest = [none] + ([uva_leanest] if uva_leanest is not None else [])
    simulated = 0
    fits_device = uva is not None
    if uva is not None and (host is None or uva.host_bytes <= host.host_budget_bytes):
        offer(uva)
    sets = layer_sets(table, max_step, budget)
    everything = next((s for s in sets if s.group_size == 1), None)  # g=1, k=1: every layer
    if everything is not None:
        expanded = expand(table, everything)
        lean = prefetch_candidate(table, expanded, 1, buffer_bytes(expanded, 1))
        if lean is not None:
            leanest.append(lean)
    for layer_set in sorted((s for s in sets if s.min_device_bytes <= budget),
                            key=lambda s: (s.bound_seconds, s.host_bytes, s.group_size, s.num_in_group)):
        if len(top) > keep:
            worst = top[-1]
            if close(layer_set.bound_seconds, worst.step_seconds):
                least = (layer_set.host_bytes, layer_set.min_device_bytes, BACKEND_ORDER["prefetch"],
                         layer_set.group_size, layer_set.num_in_group, 1, 0)
                if least >= tie_key(worst):
                    continue  # at best a tie on time, and it loses the tie
            elif layer_set.bound_seconds > worst.step_seconds:
                break  # sorted by bound: no later set can rank either
        best, runs, fitted = best_depth(table, layer_set, budget, max_step, host)
        simulated += runs
        fits_device = fits_device or fitted
        if best is not None:
            offer(best)
    bounds = host_bounds(table, sets, uva, budget, max_step, host) if not top and host is not None else None
    if bounds is not None and fits_device:
        raise bounds.refusal()
    if not top:
        lean = min(leanest, key=lambda c: (c.device_bytes, BACKEND_ORDER[c.config.backend]))
        over = lean.device_bytes - budget
        raise Refusal(
            f"no configuration fits the device budget of {format_bytes(budget)} ({budget} bytes): the leanest, "
            f"{describe(lean.config, joiner=' with ')}, needs {format_bytes(lean.device_bytes)} "
            f"({lean.device_bytes} bytes = "
            f"resident {lean.resident_bytes} + buffers {lean.buffer_bytes} + on-demand {lean.transient_bytes} + "
            f"outside {lean.outside_bytes} + reserve {lean.reserve_bytes}), {over} bytes ({format_bytes(over)}) more than the budget",
            name="device_budget_bytes",
            value=budget,
            bounds=bounds,
        )
    return _result(spec, penv, table, budget, top[0], tuple(top[1:]),
                   simulated=simulated + (uva is not None), considered=1 + (uva is not None) + len(sets), host=host,
                   size_caches=expert_slots is None, routing=routing)


def _result(spec: ModelSpec, penv: EnvSnapshot, table: Table, budget: int, best: FitCandidate,
            others: tuple[FitCandidate, ...], *, simulated: int, considered: int,
            host: HostTier | None = None, size_caches: bool = False,
            routing: RoutingTrace | None = None) -> FitResult:
    """Make the real plan of the winner and check it against the search's prediction (with
    `host`: its step with its disk tier, and the host memory it then takes); with
    `size_caches`, give its expert caches the slots the budget has room for (`_sized`),
    and with `routing` its step at those slots."""
    def step_of(plan: OffloadPlan) -> tuple[StepEstimate, int]:
        if host is not None and plan.backend.value == "prefetch":
            return host.estimate(plan, table.profile, table.workload, routing=routing)
        return estimate(plan, table.profile, table.workload, routing=routing), plan.host_bytes

    plan = make_plan(spec, best.config, penv)
    step, host_bytes = step_of(plan)
    chosen = attrs.evolve(
        best, step_seconds=step.step_seconds, limit_seconds=step.limit_seconds,
        resident_bytes=plan.device_bytes_resident, buffer_bytes=plan.device_bytes_buffers,
        transient_bytes=max((layer.on_demand_bytes for layer in step.layers), default=0),
        host_bytes=host_bytes,
    )
    if chosen.device_bytes != best.device_bytes or not close(chosen.step_seconds, best.step_seconds) \
            or chosen.host_bytes != best.host_bytes:
        raise PlanError(
            f"internal inconsistency: the search predicted {best.device_bytes} device bytes, {best.host_bytes} host "
            f"bytes and a {best.step_seconds} s step for {describe(best.config, joiner=' with ')}, its plan takes "
            f"{chosen.device_bytes}, {chosen.host_bytes} and {chosen.step_seconds} s; please report this",
            name="config", value=best.config,
        )
    if size_caches and (plan.experts or best.config.expert_slots is not None):
        # (A winner without caches, its MoE layers resident, states no C.)
        config = _sized(best.config, plan, budget - chosen.device_bytes) if plan.experts else \
            attrs.evolve(best.config, expert_slots=None)
        if config != best.config:
            plan = make_plan(spec, config, penv)
            chosen = attrs.evolve(chosen, config=config, buffer_bytes=plan.device_bytes_buffers)
            step = step_of(plan)[0]  # over a trace, more slots, more hits: the step at the winner's own C
            chosen = attrs.evolve(chosen, step_seconds=step.step_seconds, limit_seconds=step.limit_seconds)
    return FitResult(budget_bytes=budget, chosen=chosen, plan=plan, estimate=step, runners_up=others,
                     profile=table.profile, workload=table.workload, env=penv,
                     simulated=simulated, considered=considered,
                     host_budget_bytes=host.host_budget_bytes if host is not None else None)


def _sized(config: OffloadConfig, plan: OffloadPlan, spare: int) -> OffloadConfig:
    """`config` (whose `plan` has expert caches of one slot each) with the caches' default
    slots where they take at most `spare` more device bytes, or else with the largest C
    whose caches do (one at least: `plan` fits)."""
    groups = [cache.group for cache in plan.experts]
    if sum((default_slots(g) - 1) * g.expert_bytes for g in groups) <= spare:
        return attrs.evolve(config, expert_slots=None)
    per_slot = sum(g.expert_bytes for g in groups)
    return attrs.evolve(config, expert_slots=min(1 + spare // per_slot, min(g.num_experts for g in groups)))
