"""The device expert cache (Note [expert cache]) on seven small random MoE models: every
offloaded layer's experts copied expert by expert as the routing asks, outputs bit for bit
the resident model's in prefill and decode for each experts implementation, the bytes
copied counted exactly, the residents shown by ``check()``, bad routing refused."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from offload.errors import ConfigError, ExecutionError, PlanError
from offload.hf import offload_model
from offload.model.describe import describe_layers
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvFlags, EnvSnapshot
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import profile_by_name
from offload.pure.fit.search import fit
from offload.pure.spec.experts import Routing
from offload.runtime.cpu import CpuRuntime
from tests.hf.moe_models import MOE_ARCHITECTURES, build_moe, implementations
from tests.hf.moe_models import decode_logits as _decode
from tests.hf.moe_models import same_logits as _equal

EVERY_LAYER = OffloadConfig(group_size=1, prefetch_step=2)
CASES = [(name, impl) for name in MOE_ARCHITECTURES for impl in implementations(name)]


def _offload(model: Any, config: OffloadConfig = EVERY_LAYER) -> Any:
    return offload_model(model, config, env=EnvSnapshot(), runtime=CpuRuntime())


@pytest.mark.parametrize("name", list(MOE_ARCHITECTURES))
def test_each_experts_module_carries_its_routers_top_k(name: str) -> None:
    """The top-k is read off the MoE block or its router (their ``top_k``), as the
    config's ``num_experts_per_tok`` set it."""
    model = build_moe(name, 2)
    groups = describe_layers(model.model.layers).experts
    assert [g.top_k for g in groups] == [model.config.num_experts_per_tok] * 2


def test_a_top_k_the_block_and_its_router_disagree_on_is_not_taken() -> None:
    model = build_moe("qwen3_moe", 1)
    block = model.model.layers[0].mlp
    block.top_k = block.gate.top_k + 1
    assert describe_layers(model.model.layers).experts[0].top_k is None
    block.top_k = block.gate.top_k
    assert describe_layers(model.model.layers).experts[0].top_k == block.gate.top_k


@pytest.mark.parametrize(("name", "impl"), CASES)
@pytest.mark.parametrize("batch", [1, 4])
def test_prefill_and_decode_are_bit_for_bit_the_resident_models(name: str, impl: str, batch: int) -> None:
    expected = _decode(build_moe(name, 2, experts_implementation=impl), batch)
    model = build_moe(name, 2, experts_implementation=impl)
    offloader = _offload(model)
    assert len(offloader.plan.experts) == 2  # every layer's experts, by the default config
    routing = {c.group.routing for c in offloader.plan.experts}
    assert routing == {Routing.SCORES if name == "llama4" else Routing.INDICES}
    assert _equal(_decode(model, batch), expected)
    stats = offloader.stats()
    assert all(c.hits + c.misses > 0 for c in stats.experts)  # the caches served every step
    offloader.restore()
    assert _equal(_decode(model, batch), expected)  # restored exactly


@pytest.mark.parametrize("slots", [1, 3, 16])
def test_every_cache_size_is_exact(slots: int) -> None:
    expected = _decode(build_moe("qwen2_moe", 2), 2, steps=4)
    model = build_moe("qwen2_moe", 2)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=slots))
    assert {c.slots for c in offloader.plan.experts} == {slots}
    assert _equal(_decode(model, 2, steps=4), expected)
    residents = offloader.check().expert_residents
    assert [len(experts) for _, _, experts in residents] == [slots, slots]  # full after a prefill of 16 tokens


def _routed(model: Any, batch: int) -> list[list[tuple[int, ...]]]:
    """The experts each layer routes at each forward of `_decode`, recorded from the
    experts modules' inputs of the resident model."""
    seen: list[list[tuple[int, ...]]] = []

    def record(module: Any, args: tuple[Any, ...]) -> None:
        seen[-1].append(tuple(int(e) for e in torch.unique(args[1]).tolist()))

    handles = [layer.mlp.experts.register_forward_pre_hook(record) for layer in model.model.layers]
    forwards = [0]

    def begin(module: Any, args: tuple[Any, ...]) -> None:
        seen.append([])
        forwards[0] += 1

    handles.append(model.model.register_forward_pre_hook(begin))
    _decode(model, batch)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("batch", [1, 4])
def test_each_step_copies_the_non_expert_weights_and_the_misses_exactly(batch: int) -> None:
    model = build_moe("qwen3_moe", 4)
    routed = _routed(build_moe("qwen3_moe", 4), batch)
    offloader = _offload(model)
    plan = offloader.plan
    expert_refs = {(c.layer, name) for c in plan.experts for name in c.group.params}
    # A kept position (the only owner of its slot) is copied once, at post_init.
    copied_layers = {layer for position, layer in enumerate(plan.offloaded_layers)
                     if position not in plan.schedule.kept_positions}
    assert copied_layers
    non_expert = sum(p.nbytes for p in plan.offloaded_params
                     if (p.layer, p.name) not in expert_refs and p.layer in copied_layers)
    expert_bytes = {c.layer: c.group.expert_bytes for c in plan.experts}
    copied: list[int] = []
    misses: list[dict[int, int]] = []
    hooks = []

    def before(module: Any, args: tuple[Any, ...]) -> None:
        stats = offloader.stats()
        copied.append(stats.bytes_copied)
        misses.append({c.layer: c.misses for c in stats.experts})

    hooks.append(model.model.register_forward_pre_hook(before))
    _decode(model, batch)
    hooks[0].remove()
    before(model, ())
    for step in range(1, len(copied) - 1):  # each step's copies: issued during the step before it, ahead
        missed = {layer: misses[step + 1][layer] - misses[step][layer] for layer in expert_bytes}
        got = copied[step + 1] - copied[step]
        assert got == non_expert + sum(missed[layer] * expert_bytes[layer] for layer in missed), step
    # and the misses are the routed experts the cache did not hold: never more than routed
    for step, per_layer in enumerate(routed):
        for layer, experts in enumerate(per_layer):
            assert misses[step + 1][layer] - misses[step][layer] <= len(experts)


def test_a_routing_index_outside_the_experts_is_refused_before_any_copy() -> None:
    model = build_moe("mixtral", 2)
    offloader = _offload(model)
    experts = model.model.layers[0].mlp.experts
    before = offloader.stats()
    hidden = torch.zeros(2, 32)
    weights = torch.ones(2, 2)
    for bad in (8, -1):
        index = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(ExecutionError, match=rf"routing index {bad} is outside the 8 experts"):
            experts(hidden, index, weights)
    after = offloader.stats()
    assert after.bytes_copied == before.bytes_copied and after.experts == before.experts


def test_cache_sizes_outside_one_to_the_expert_count_are_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="expert_slots must be None or an integer >= 1, got 0"):
        OffloadConfig(group_size=1, expert_slots=0)
    model = build_moe("mixtral", 2)
    with pytest.raises(PlanError, match=r"expert_slots \(C\) 9 is more than the 8 experts of layer 0 \(mlp.experts\): C must be 1 to 8"):
        _offload(model, OffloadConfig(group_size=1, expert_slots=9))
    assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in model.parameters())


@pytest.mark.parametrize("cache", [False, True])
def test_expert_cache_off_streams_the_layer_whole(cache: bool) -> None:
    expected = _decode(build_moe("olmoe", 4), 1)
    model = build_moe("olmoe", 4)
    # Two slots for four layers: no position is kept, every layer is copied every step.
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=1, expert_cache=cache))
    assert len(offloader.plan.experts) == (4 if cache else 0)
    assert not offloader.plan.schedule.kept_positions
    copied = []
    hook = model.model.register_forward_pre_hook(lambda *_: copied.append(offloader.stats().bytes_copied))
    assert _equal(_decode(model, 1), expected)
    hook.remove()
    whole = sum(p.nbytes for p in offloader.plan.offloaded_params)
    decode_step = copied[2] - copied[1]  # one token's step, copied ahead while the one before it ran
    if cache:
        assert decode_step < whole / 2  # 8 of 64 experts routed per layer
        assert offloader.stats().experts
    else:
        assert decode_step == whole
        assert offloader.stats().experts == ()


def test_new_weights_reset_the_caches() -> None:
    twin = build_moe("qwen3_moe", 2, seed=1)
    expected = _decode(twin, 1)
    model = build_moe("qwen3_moe", 2, seed=0)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=64))
    first = _decode(model, 1)
    assert not _equal(first, expected)
    assert all(experts for _, _, experts in offloader.check().expert_residents)  # the old weights cached
    offloader.load_weights({name: t.clone() for name, t in twin.state_dict().items()})
    assert all(not experts for _, _, experts in offloader.check().expert_residents)
    assert _equal(_decode(model, 1), expected)
    model.load_state_dict(build_moe("qwen3_moe", 2, seed=0).state_dict())
    assert _equal(_decode(model, 1), first)


def test_check_lists_each_caches_residents_and_counts_their_bytes() -> None:
    model = build_moe("gpt_oss", 2)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=4))
    found = offloader.check()
    assert [(layer, module) for layer, module, _ in found.expert_residents] == [(0, "mlp.experts"),
                                                                                 (1, "mlp.experts")]
    assert found.device_bytes_held == found.plan_device_bytes
    assert found.ok
    _decode(model, 1)
    found = offloader.check()
    stats = offloader.stats()
    for (layer, _, experts), counts in zip(found.expert_residents, stats.experts, strict=True):
        assert len(experts) == 4 and all(0 <= e < 32 for e in experts)
        assert counts.layer == layer and counts.hits + counts.misses > 0
    assert found.ok  # the experts' slots are not compared with their host copies


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "llama4"])
def test_every_layers_experts_read_one_set_of_rows_per_key_and_the_device_holds_what_the_plan_says(
        name: str) -> None:
    """Six layers in several prefetch slots: the experts' rows of every layer are one device
    buffer per key (`BufferPlan.shared`), the other weights one per slot; outputs exact."""
    expected = _decode(build_moe(name, 6), 4)
    model = build_moe(name, 6)
    offloader = _offload(model)
    plan = offloader.plan
    group = plan.experts[0].group
    buffers = {b.name: b for b in plan.buffers}
    assert {n for n, b in buffers.items() if b.shared} == set(group.params)
    assert all(len(b.slots) > 1 for b in buffers.values())  # the layers take turns in them
    layers = model.model.layers
    for param in group.params:
        assert len({layer.get_parameter(param).untyped_storage().data_ptr() for layer in layers}) == 1
    other = next(n for n, b in buffers.items() if not b.shared)
    assert len({layer.get_parameter(other).untyped_storage().data_ptr() for layer in layers}) == len(buffers[other].slots)
    stats = offloader.stats()
    assert stats.device_buffer_bytes == plan.device_bytes_buffers
    assert offloader.check().device_bytes_held == plan.device_bytes_resident + plan.device_bytes_buffers
    assert _equal(_decode(model, 4), expected)


def test_a_cuda_graph_capture_is_refused_naming_the_layer_before_touching_the_device() -> None:
    from offload.graphs import capture_forward

    model = build_moe("mixtral", 2)
    offloader = _offload(model)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ExecutionError, match=r"layer 0 mlp\.experts \(and 1 more experts modules\).*"
                                             r"expert_cache=False"):
        capture_forward(lambda x: model(input_ids=x), ids, offloader)
    assert offloader.stats().steps == 0  # nothing ran


def test_torch_compile_stays_exact_with_a_break_at_the_experts_call() -> None:
    expected = build_moe("qwen2_moe", 2)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = expected(input_ids=ids).logits
    model = build_moe("qwen2_moe", 2)
    offloader = _offload(model)
    compiled = torch.compile(model.model.layers[0], backend="eager")
    model.model.layers[0] = compiled
    with torch.inference_mode():
        first = model(input_ids=ids).logits
        second = model(input_ids=ids).logits
    assert torch.equal(first, want) and torch.equal(second, want)
    assert offloader.stats().experts[0].hits + offloader.stats().experts[0].misses > 0


def test_a_recorded_profile_holds_the_hottest_experts_and_stays_exact() -> None:
    from offload.executors.experts import record_routing
    from offload.pure.experts.values import RoutingProfile

    resident = build_moe("qwen3_moe", 2)
    with record_routing(resident.model.layers) as record:
        expected = _decode(resident, 1, steps=4)
    profile = record.profile()
    assert [(layer, module, len(counts)) for layer, module, counts in profile.counts] == [
        (0, "mlp.experts", 64), (1, "mlp.experts", 64)]
    assert sum(profile.counts[0][2]) == 8 * (8 + 4)  # top-8 of every token: the prompt's 8 and 4 decoded
    trace = record.trace()
    assert len(trace.steps) == 5 and all(len(step[0]) <= 64 for step in trace.steps)
    model = build_moe("qwen3_moe", 2)
    config = OffloadConfig(group_size=1, prefetch_step=2, expert_slots=8, routing_profile=profile)
    offloader = _offload(model, config)
    for cache, (_, _, counts) in zip(offloader.plan.experts, profile.counts, strict=True):
        hottest = sorted(range(64), key=lambda j: (-counts[j], j))[:4]
        assert cache.held == tuple(sorted(hottest))  # half the slots
    assert _equal(_decode(model, 1, steps=4), expected)
    for cache, (_, _, residents) in zip(offloader.plan.experts, offloader.check().expert_residents, strict=True):
        assert set(cache.held) <= set(residents)
    other = RoutingProfile(counts=((0, "mlp.experts", (1,) * 64),))  # layer 1 missing
    with pytest.raises(PlanError, match="mlp.experts"):
        _offload(build_moe("qwen3_moe", 2), attrs.evolve(config, routing_profile=other))


@pytest.mark.parametrize("name", ["qwen3_moe", "llama4"])
def test_replaying_the_recorded_trace_predicts_the_executors_counts_and_bytes_exactly(name: str) -> None:
    from offload.executors.experts import record_routing
    from offload.pure.experts.replay import belady, replay

    model = build_moe(name, 2)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=4))
    with record_routing(model.model.layers) as record:
        _decode(model, 2, steps=6)
    trace = record.trace()
    assert len(trace.steps) == 7
    predicted = replay(offloader.plan.experts, trace)
    measured = offloader.stats().experts
    assert [(g.hits, g.misses, g.evictions) for g in predicted.groups] == [
        (c.hits, c.misses, c.evictions) for c in measured]
    assert predicted.total_bytes == sum(c.bytes_copied for c in measured) > 0
    optimum = belady(offloader.plan.experts, trace)
    assert optimum.hits >= predicted.hits


@pytest.mark.parametrize(("layers", "fraction"), [(4, 0.8), (8, 0.95), (8, 0.9)])
def test_a_device_budget_plans_the_caches_within_it_and_stays_exact(layers: int, fraction: float) -> None:
    """`offload_model(device_budget_bytes=)` on a MoE model: fit counts the caches, so the
    plan it makes for the device (an H100 with zero-copy off, where prefetch wins these
    budgets) takes at most the budget, the caches as many slots as it has room for, and
    the model run here with that configuration decodes bit for bit."""
    expected = _decode(build_moe("qwen3_moe", layers), 2)
    model = build_moe("qwen3_moe", layers)
    spec = describe_layers(model.model.layers)
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - spec.nbytes
    budget = outside + int(spec.nbytes * fraction)
    env, profile = EnvSnapshot(flags=EnvFlags(disable_uva=True)), profile_by_name("h100-pcie5")
    fitted = fit(spec, env, profile, Workload(), budget, outside_bytes=outside)
    device = fitted.plan
    assert device.experts and device.device_bytes_resident + device.device_bytes_buffers + outside <= budget
    one_more = sum(c.group.expert_bytes for c in device.experts)
    slots = fitted.chosen.config.expert_slots
    assert slots is None or device.device_bytes_resident + device.device_bytes_buffers + outside + one_more > budget
    offloader = offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile)
    assert offloader.plan.config == fitted.chosen.config
    assert [c.slots for c in offloader.plan.experts] == [c.slots for c in device.experts]
    assert _equal(_decode(model, 2), expected)
    offloader.restore()


@pytest.mark.parametrize(("name", "batch"), [("qwen3_moe", 1), ("qwen3_moe", 4), ("llama4", 4)])
def test_the_estimate_given_the_recorded_trace_predicts_the_bytes_and_hit_rate_the_executor_copies(
        name: str, batch: int) -> None:
    """`estimate(..., routing=)` over the trace of the run: the layers' copies per step are
    their non-expert weights (counted here from the plan), the experts' are the misses the
    executor counted, to the byte per layer and step (the estimate rounds its means)."""
    from offload.executors.experts import record_routing
    from offload.pure.fit.estimate import estimate

    model = build_moe(name, 4)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=4))
    with record_routing(model.model.layers) as record:
        _decode(model, batch, steps=6)
    trace = record.trace()
    plan = offloader.plan
    step = estimate(plan, profile_by_name("h100-pcie5"), Workload(tokens_per_step=batch), routing=trace)
    measured = offloader.stats().experts
    steps = len(trace.steps)
    assert step.routing_steps == steps == 7
    served = {(c.layer, n) for c in plan.experts for n in c.group.params}
    copied = {layer for position, layer in enumerate(plan.offloaded_layers)
              if position not in plan.schedule.kept_positions}
    non_expert = sum(p.nbytes for p in plan.offloaded_params if (p.layer, p.name) not in served and p.layer in copied)
    assert sum(layer.copy_bytes for layer in step.layers) == non_expert
    missed = sum(c.bytes_copied for c in measured)
    assert missed > 0
    assert abs(step.expert_bytes * steps - missed) <= len(plan.experts) * steps / 2
    assert abs(step.expert_bytes * steps - missed) <= 0.02 * missed
    hits = sum(c.hits for c in measured)
    rate = step.expert_hit_rate
    assert rate is not None and rate == pytest.approx(hits / (hits + sum(c.misses for c in measured)))
    assert step.belady_hit_rate is not None and step.belady_hit_rate >= rate


def _budget_case(layers: int = 4) -> tuple[Any, int, EnvSnapshot, Any]:
    model = build_moe("qwen3_moe", layers)
    spec = describe_layers(model.model.layers)
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - spec.nbytes
    return model, outside + int(spec.nbytes * 0.8), EnvSnapshot(flags=EnvFlags(disable_uva=True)), \
        profile_by_name("h100-pcie5")


def test_a_device_budget_takes_the_expert_options_and_stays_exact() -> None:
    """With a budget there is no config to carry them: `offload_model` takes the expert
    options itself, `fit` searches with them, and the chosen plan holds them."""
    from offload.executors.experts import record_routing
    from offload.pure.experts.profile import held_from_profile

    expected = _decode(build_moe("qwen3_moe", 4), 2)
    model, budget, env, profile = _budget_case()
    off = offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                        expert_cache=False)
    assert off.plan.experts == () and off.plan.config.expert_cache is False
    assert _equal(_decode(model, 2), expected)
    off.restore()
    off = offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                        expert_slots=3)
    assert off.plan.experts and all(c.slots == 3 for c in off.plan.experts)
    assert _equal(_decode(model, 2), expected)
    off.restore()
    with record_routing(model.model.layers) as record:
        _decode(model, 2)
    recorded = record.profile()
    off = offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                        expert_slots=4, routing_profile=recorded)
    assert [c.held for c in off.plan.experts] == [held_from_profile(recorded, c.group, 2) for c in off.plan.experts]
    assert any(c.held for c in off.plan.experts)
    assert _equal(_decode(model, 2), expected)
    off.restore()


def test_a_device_budget_takes_a_routing_trace_and_plans_what_fit_plans_over_it() -> None:
    from offload.executors.experts import record_routing

    expected = _decode(build_moe("qwen3_moe", 4), 2)
    model, budget, env, profile = _budget_case()
    with record_routing(model.model.layers) as record:
        _decode(model, 2)
    trace = record.trace()
    spec = describe_layers(model.model.layers)
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - spec.nbytes
    wanted = fit(spec, env, profile, Workload(), budget, outside_bytes=outside, routing=trace)
    worst = fit(spec, env, profile, Workload(), budget, outside_bytes=outside)
    assert wanted.estimate.routing_steps == len(trace.steps) and worst.estimate.routing_steps == 0
    off = offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                        routing_trace=trace)
    assert off.plan.config == wanted.plan.config
    assert _equal(_decode(model, 2), expected)
    off.restore()


def test_a_routing_trace_beside_a_config_not_a_trace_or_of_another_model_is_refused_before_anything_moves(
        ) -> None:
    from offload.executors.experts import record_routing

    model, budget, env, profile = _budget_case(2)
    other = build_moe("qwen3_moe", 3)
    with record_routing(other.model.layers) as record:
        _decode(other, 1)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="routing_trace is for a budget: fit costs the expert caches") as caught:
        offload_model(model, EVERY_LAYER, env=env, runtime=CpuRuntime(), routing_trace=record.trace())
    assert caught.value.name == "routing_trace"
    with pytest.raises(ConfigError, match="routing_trace must be a RoutingTrace") as caught:
        offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                      routing_trace=record.profile())  # type: ignore[arg-type]  # deliberately wrong
    with pytest.raises(PlanError, match="2:mlp.experts is not this model's"):
        offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                      routing_trace=record.trace())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before


def test_expert_options_beside_a_config_or_out_of_range_are_refused_before_anything_moves() -> None:
    model, budget, env, profile = _budget_case(2)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"expert_slots: with config=, set it on the config") as caught:
        offload_model(model, EVERY_LAYER, env=env, runtime=CpuRuntime(), expert_slots=2)
    assert caught.value.name == "expert_slots" and caught.value.value == 2
    with pytest.raises(ConfigError, match="expert_cache, expert_slots: with config=, set them"):
        offload_model(model, EVERY_LAYER, env=env, runtime=CpuRuntime(), expert_cache=False, expert_slots=2)
    with pytest.raises(ConfigError) as caught:
        offload_model(model, device_budget_bytes=budget, env=env, runtime=CpuRuntime(), profile=profile,
                      expert_slots=0)
    assert caught.value.name == "expert_slots" and caught.value.value == 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == before
