"""`estimate(..., routing=)`: a routing trace replaces the worst case for MoE layers.

An expert cache's experts are never in their layer's prefetch copy: the layer waits at its
experts' call for the misses (from host memory, and from disk on the disk tier) and for the
hits' device copies, by the trace's mean per step; without a trace, for their worst case
(every expert, where no top-k is known). The numbers below are worked by hand from the trace: two
layers of 4 experts of 96 bytes each, 2 slots per cache, the default policy (LFU).

Layer 0 routes (0, 1) four times: 2 misses, then 6 hits. Layer 1 routes one expert a step,
each a miss (2, 3, then one that evicts 2, then 2 again): 4 misses, no hit; Belady keeps 2
for its return and misses three.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import EnvSnapshot, OffloadConfig, OffloadPlan, make_plan
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.tier import plan_disk_tier
from offload.pure.experts.replay import replay, zipf_trace
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.render import render_estimate
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import ModelSpec
from tests.pure.fit.test_estimate import ENV, TOY
from tests.pure.fit.test_search_experts import moe_spec

#: 6 layers of an 8-float attention weight (32 bytes) and 4 experts of 3 x 2 x 4 floats
#: (96 bytes): gate_up 256 bytes, down 128 bytes, 384 bytes of experts per layer.
SPEC = moe_spec([(8, 4)] * 6)
B = 96
EXPERT_BYTES = 4 * B
#: Weight reads at 1000 B/s, so that a hit's device copy (a read and a write) costs 2 x B / 1000 s.
PROFILE = attrs.evolve(TOY, weight_read_bytes_per_s=1000.0)
WORKLOAD = Workload(tokens_per_step=1)
LAYER_0 = ((0, 1),) * 4


def _plan(spec: ModelSpec = SPEC, env: EnvSnapshot = ENV, **config: object) -> OffloadPlan:
    settings: dict[str, object] = {"backend": "prefetch", "group_size": 1, "prefetch_step": 2, "expert_slots": 2,
                                   **config}
    return make_plan(spec, OffloadConfig(**settings), env)  # type: ignore[arg-type]


def _trace(spec: ModelSpec, first: tuple[tuple[int, ...], ...], second: tuple[tuple[int, ...], ...],
           rest: tuple[int, ...] = ()) -> RoutingTrace:
    """Layers 0 and 1 route `first` and `second`; every other layer routes `rest` each step."""
    groups = spec.experts
    steps = tuple((a, b, *([rest] * (len(groups) - 2))) for a, b in zip(first, second, strict=True))
    return RoutingTrace(groups=groups, steps=steps)


def test_the_trace_takes_the_experts_out_of_the_copies_and_waits_for_its_misses_and_hits() -> None:
    plan = _plan()
    assert {c.layer for c in plan.experts} == set(range(6))
    worst = estimate(plan, PROFILE, WORKLOAD)
    # Layer 1 routes 2, 3, 0, 2 here: 3 takes the free slot, 0 evicts 2 (the least recent
    # of equal counts), 2 misses again: 4 misses. The other layers route nothing.
    trace = _trace(SPEC, LAYER_0, ((2,), (3,), (0,), (2,)))
    step = estimate(plan, PROFILE, WORKLOAD, routing=trace)
    rate = step.copy_bytes_per_s
    assert step.routing_steps == 4
    for worst_layer, layer in zip(worst.layers, step.layers, strict=True):
        # Without a trace (and no top-k), every expert may miss at each call.
        assert worst_layer.expert_bytes == EXPERT_BYTES and worst_layer.expert_routed == 4
        assert worst_layer.copy_bytes == layer.copy_bytes  # the experts are in neither copy
        if layer.copy_bytes:
            assert layer.copy_bytes == 32
        assert layer.compute_seconds == worst_layer.compute_seconds  # the experts still run
    zero, one = step.layers[0], step.layers[1]
    assert zero.expert_bytes == 2 * B / 4 and one.expert_bytes == 4 * B / 4
    assert (zero.expert_routed, zero.expert_hits) == (2.0, 1.5)
    assert (one.expert_routed, one.expert_hits) == (1.0, 0.0)
    assert zero.expert_seconds == pytest.approx(2 * B / 4 / rate + 2 * (6 * B / 4) / 1000.0)
    assert one.expert_seconds == pytest.approx(4 * B / 4 / rate)
    assert all(layer.expert_bytes == 0 and layer.expert_seconds == 0 for layer in step.layers[2:])
    assert step.expert_bytes == 6 * B / 4
    assert step.expert_hit_rate == pytest.approx(6 / 12)
    assert step.offloaded_bytes_per_step == sum(layer.copy_bytes for layer in step.layers) + step.expert_bytes
    # The wait is the layer's: in its wall time and in the step's.
    assert zero.seconds == pytest.approx(zero.compute_seconds + zero.stall_seconds + zero.expert_seconds)
    assert step.step_seconds == pytest.approx(sum(layer.seconds for layer in step.layers))
    assert step.expert_seconds == pytest.approx(zero.expert_seconds + one.expert_seconds)


def test_belady_is_reported_beside_the_policy_on_the_same_slots() -> None:
    """Layer 1 routes 2, 3, 4, 2 of 5 experts: LFU misses all four; Belady keeps 2 and
    misses three."""
    spec = moe_spec([(8, 5)] * 6)
    plan = _plan(spec)
    step = estimate(plan, PROFILE, WORKLOAD, routing=_trace(spec, LAYER_0, ((2,), (3,), (4,), (2,))))
    assert step.layers[1].expert_bytes == 4 * B / 4
    assert step.expert_hit_rate == pytest.approx(6 / 12)
    assert step.belady_hit_rate == pytest.approx(7 / 12)
    text = render_estimate(step)
    assert "experts ms" in text
    assert "hit rate 50.0%, Belady 58.3%, over 4 steps of the routing trace" in text
    assert f"({step.expert_bytes} bytes) of misses per step" in text


def test_without_a_trace_every_expert_may_miss_and_the_text_says_it_is_the_worst_case() -> None:
    """No module here says its top-k: each call may route, and miss, all 4 experts."""
    plan = _plan()
    step = estimate(plan, PROFILE, WORKLOAD)
    assert step.routing_steps == 0 and step.expert_hit_rate is None and step.belady_hit_rate is None
    copied = [layer for layer in step.layers if layer.copy_bytes]
    assert copied and all(layer.copy_bytes == 32 for layer in copied)
    assert all(layer.expert_bytes == EXPERT_BYTES for layer in step.layers)
    text = render_estimate(step)
    assert "experts ms" in text and "the worst case without a routing trace" in text and "hit rate" not in text


def test_a_trace_of_modules_without_a_cache_leaves_them_out() -> None:
    """Every other layer is kept resident (no cache): their steps in the trace change nothing."""
    spec = SPEC
    plan = _plan(group_size=2, num_in_group=1)
    cached = {c.layer for c in plan.experts}
    assert cached == {1, 3, 5}
    full = _trace(spec, LAYER_0, ((2,), (3,), (0,), (2,)), rest=(1, 2))
    only = RoutingTrace(groups=tuple(g for g in full.groups if g.layer in cached),
                        steps=tuple(tuple(r for g, r in zip(full.groups, s, strict=True) if g.layer in cached)
                                    for s in full.steps))
    assert estimate(plan, PROFILE, WORKLOAD, routing=full) == estimate(plan, PROFILE, WORKLOAD, routing=only)


def test_a_trace_that_misses_a_cached_module_or_has_no_steps_is_refused_naming_it() -> None:
    plan = _plan()
    short = RoutingTrace(groups=SPEC.experts[:5], steps=(((0,),) * 5,))
    with pytest.raises(PlanError, match="no steps of 5:mlp.experts, which the plan caches") as caught:
        estimate(plan, PROFILE, WORKLOAD, routing=short)
    assert caught.value.value == (5, "mlp.experts")
    with pytest.raises(PlanError, match="no steps: it predicts nothing"):
        estimate(plan, PROFILE, WORKLOAD, routing=RoutingTrace(groups=SPEC.experts, steps=()))
    other = tuple(ExpertGroup(layer=g.layer, module=g.module, num_experts=8, params=g.params, expert_bytes=B,
                              routing=Routing.INDICES) for g in SPEC.experts)
    with pytest.raises(PlanError, match="has 8 experts, its plan 4"):
        estimate(plan, PROFILE, WORKLOAD, routing=RoutingTrace(groups=other, steps=(((0,),) * 6,)))
    # A trace of a deeper model: its layer 6 is not this model's.
    deeper = moe_spec([(8, 4)] * 8)
    with pytest.raises(PlanError, match="6:mlp.experts is not this model's") as caught:
        estimate(plan, PROFILE, WORKLOAD, routing=RoutingTrace(groups=deeper.experts, steps=(((0,),) * 8,)))
    assert caught.value.value == (6, "mlp.experts")
    with pytest.raises(PlanError, match="routing must be a RoutingTrace"):
        estimate(plan, PROFILE, WORKLOAD, routing=object())  # type: ignore[arg-type]


def test_on_the_disk_tier_the_trace_reads_the_misses_at_the_call_not_the_experts_with_the_ring() -> None:
    attn = 8192  # an attention weight of 2048 floats, so that a staging buffer is not all alignment
    spec = moe_spec([(attn // 4, 4)] * 6)
    plan = _plan(spec)
    # Half the offloaded bytes: some layers on disk, read through a ring of one buffer.
    tier = plan_disk_tier(plan, host_budget_bytes=3 * (attn + EXPERT_BYTES), disk_gbps=1e-7, read_ahead=1)
    assert tier.disk_layers and all(p.in_place for p in tier.params if "experts" in p.name)
    disk_rate = 1e-7 * 1e9  # 100 B/s
    trace = _trace(spec, LAYER_0, ((2,), (3,), (0,), (2,)))
    worst = estimate_with_tier(plan, tier, PROFILE, WORKLOAD)
    step = estimate_with_tier(plan, tier, PROFILE, WORKLOAD, routing=trace)
    on_disk = set(tier.disk_layers)
    rate = step.copy_bytes_per_s
    read_per_step = 0
    for worst_layer, layer in zip(worst.layers, step.layers, strict=True):
        if layer.layer not in on_disk:
            assert layer.disk_read_seconds == 0
            continue
        misses = {0: 2 * B / 4, 1: 4 * B / 4}.get(layer.layer, 0.0)
        if worst_layer.disk_read_seconds:  # read per step by the ring: now without its experts
            assert worst_layer.disk_read_seconds == pytest.approx((attn + EXPERT_BYTES) / disk_rate)
            assert layer.disk_read_seconds == pytest.approx(attn / disk_rate + misses / disk_rate)
            read_per_step += 1
        hits = {0: 6 * B / 4}.get(layer.layer, 0.0)
        assert layer.expert_seconds == pytest.approx(misses / rate + misses / disk_rate + 2 * hits / 1000.0)
    assert read_per_step and {0, 1} & on_disk


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=5), st.integers(1, 12), st.integers(1, 4),
       st.integers(1, 3), st.integers(0, 2**31), st.sampled_from([1, 2, 3]))
def test_the_estimates_expert_bytes_are_the_replays_per_layer_and_step(experts: list[int], steps: int, slots: int,
                                                                       tokens: int, seed: int, depth: int) -> None:
    """For any model, cache size and Zipf trace: each layer's expert bytes per step are the
    replay's misses x B over the steps (rounded), and the step's bytes are the copies plus
    those; the hit rate is the replay's."""
    spec = moe_spec([(8, e) for e in experts])
    plan = _plan(spec, expert_slots=min(slots, min(experts)), prefetch_step=min(depth, len(experts)))
    trace = zipf_trace(spec.experts, steps=steps, top_k=min(2, min(experts)), tokens=tokens, seed=seed)
    step = estimate(plan, PROFILE, WORKLOAD, routing=trace)
    replayed = replay(plan.experts, trace)
    for g in replayed.groups:
        assert step.layers[g.layer].expert_bytes == round(g.miss_bytes / steps)
    assert step.offloaded_bytes_per_step == sum(layer.copy_bytes for layer in step.layers) + step.expert_bytes
    assert step.expert_hit_rate == pytest.approx(replayed.hit_rate)
    assert step.belady_hit_rate is not None and step.expert_hit_rate is not None
    assert step.belady_hit_rate >= step.expert_hit_rate - 1e-12
    assert abs(step.expert_bytes * steps - replayed.total_bytes) <= len(experts) * steps / 2


def test_without_a_trace_a_layer_alone_in_its_slot_still_copies_its_experts_at_each_call() -> None:
    """Six layers at depth 6: each alone in its slot keeps its attention weight there for
    good, but its experts' rows are shared by all six, so its cache copies every expert at
    every call (the worst case without a trace), waited for at the call."""
    plan = _plan(prefetch_step=6)
    assert len(plan.schedule.kept_positions) == 6
    step = estimate(plan, PROFILE, WORKLOAD)
    rate = step.copy_bytes_per_s
    for layer in step.layers:
        assert layer.copy_bytes == 0 and layer.loaded_once_bytes == 32
        assert layer.expert_bytes == EXPERT_BYTES
        assert layer.expert_seconds == pytest.approx(EXPERT_BYTES / rate)
    assert step.offloaded_bytes_per_step == 6 * EXPERT_BYTES
    assert step.expert_hit_rate is None


def test_a_kept_layers_resident_weights_are_not_counted_as_its_experts() -> None:
    """With a filter that offloads only the experts, the attention weights stay resident:
    a layer alone in its slot copies its experts at each call, and nothing else."""
    plan = _plan(prefetch_step=6, param_filter=("mlp.experts",))
    assert len(plan.schedule.kept_positions) == 6
    assert all(p.placement.value == "resident" for p in plan.params if p.name == "attn.weight")
    step = estimate(plan, PROFILE, WORKLOAD)
    assert all(layer.expert_bytes == EXPERT_BYTES and layer.loaded_once_bytes == 0 for layer in step.layers)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(2, 12)), min_size=2, max_size=6), st.integers(1, 8),
       st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 3),
       st.booleans(), st.booleans())
def test_no_step_is_shorter_than_its_bytes_over_the_one_link(
        layers: list[tuple[int, int | None]], steps: int, slots: int, tokens: int, seed: int, depth: int, group: int,
        traced: bool, top_k: bool) -> None:
    """The expert caches' misses cross the same link as the prefetch copies (they queue
    behind them on the copy stream): a step is never shorter than every byte it moves over
    the pinned rate, with a trace, with the top-k bound, or without either."""
    spec = moe_spec(layers, top_k=2 if top_k else None)
    experts = [e for _, e in layers if e is not None]
    plan = _plan(spec, expert_slots=min(slots, min(experts)), group_size=min(group, len(experts)),
                 prefetch_step=min(depth, len(experts)))
    trace = zipf_trace(spec.experts, steps=steps, top_k=2, tokens=tokens, seed=seed) if traced else None
    fast = attrs.evolve(PROFILE, bf16_flops_per_s=1e9)  # the link, not the compute, decides
    step = estimate(plan, fast, Workload(tokens_per_step=tokens), routing=trace)
    assert step.step_seconds >= step.link_seconds * (1 - 1e-9)
