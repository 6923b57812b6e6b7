"""The rows an expert cache serves are one device buffer per key for all prefetch slots
(`BufferPlan.shared`): only each experts module's call writes them, with the experts it
routes, so the layers taking turns in the slots need no set of rows each. A key that any
parameter copied by the queue also has stays one buffer per slot."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import EnvSnapshot, OffloadConfig, OffloadPlan, Placement, make_plan
from offload.pure.plan.blocks import layer_copies
from offload.pure.plan.render import render_plan
from offload.pure.plan.revise import revise_plan
from offload.pure.plan.values import BufferPlan
from offload.pure.spec.values import ModelSpec, contiguous_stride
from tests.pure.fit.test_search_experts import moe_spec, moe_specs

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SIX = moe_spec([(8, 16)] * 6)


def _plan(spec: ModelSpec = SIX, **config: object) -> OffloadPlan:
    settings: dict[str, object] = {"backend": "prefetch", "group_size": 1, "prefetch_step": 2, **config}
    return make_plan(spec, OffloadConfig(**settings), EnvSnapshot())  # type: ignore[arg-type]


def _by_name(plan: OffloadPlan) -> dict[str, BufferPlan]:
    return {b.name: b for b in plan.buffers}


def _param_bytes(spec: ModelSpec, name: str) -> int:
    return next(p.nbytes for p in spec.layers[0].params if p.name == name)


def test_the_expert_rows_are_one_buffer_for_every_slot_and_the_rest_one_per_slot() -> None:
    plan = _plan()
    assert len(plan.experts) == 6
    buffers = _by_name(plan)
    slots = len(buffers["attn.weight"].slots)
    assert slots > 1  # the layers take turns in several slots
    assert not buffers["attn.weight"].shared
    assert buffers["attn.weight"].nbytes == slots * _param_bytes(SIX, "attn.weight")
    for name in EXPERTS:
        assert buffers[name].shared and len(buffers[name].slots) == slots
        assert buffers[name].nbytes == _param_bytes(SIX, name)  # once, whatever the slots
    expected = slots * _param_bytes(SIX, "attn.weight") + sum(_param_bytes(SIX, n) for n in EXPERTS) \
        + sum(c.device_bytes for c in plan.experts)
    assert plan.device_bytes_buffers == expected


def test_without_expert_caches_the_experts_are_streamed_whole_one_buffer_per_slot() -> None:
    plan = _plan(expert_cache=False)
    assert plan.experts == ()
    buffers = _by_name(plan)
    assert not any(b.shared for b in plan.buffers)
    slots = len(buffers["attn.weight"].slots)
    for name in EXPERTS:
        assert buffers[name].nbytes == slots * _param_bytes(SIX, name)


def test_a_key_that_a_weight_the_queue_copies_also_has_stays_one_buffer_per_slot() -> None:
    """Layer 2's tensors are named and shaped like the experts of the others but it has no
    experts module: the queue copies them into their slots, so their keys are per slot."""
    spec = attrs.evolve(SIX, experts=tuple(g for g in SIX.experts if g.layer != 2))
    plan = _plan(spec)
    assert {c.layer for c in plan.experts} == {0, 1, 3, 4, 5}
    assert not any(b.shared for b in plan.buffers)


def test_a_layer_whose_cache_the_revision_drops_makes_its_keys_per_slot_again() -> None:
    """Layer 0's gate_up loses a row after post-processing: its cache goes, its down_proj is
    copied by the queue again, so the down_proj key is per slot; gate_up keeps its rows in
    the other layers (layer 0's now has a key of its own)."""
    plan = _plan()
    old = next(p for p in plan.params if (p.layer, p.name) == (0, EXPERTS[0])).param
    shape = (old.shape[0] - 1, *old.shape[1:])
    revised = revise_plan(plan, {(0, EXPERTS[0]): attrs.evolve(old, shape=shape, stride=contiguous_stride(shape))})
    assert {c.layer for c in revised.experts} == {1, 2, 3, 4, 5}
    shared = {(b.name, b.shape[0]) for b in revised.buffers if b.shared}
    assert shared == {(EXPERTS[0], 16)}
    assert revised.device_bytes_buffers == sum(b.nbytes for b in revised.buffers) + \
        sum(c.device_bytes for c in revised.experts)


def test_a_buffer_marked_shared_that_the_queue_copies_into_is_refused_naming_it() -> None:
    plan = _plan()
    j = next(i for i, b in enumerate(plan.buffers) if b.name == "attn.weight")
    buffers = list(plan.buffers)
    buffers[j] = attrs.evolve(buffers[j], shared=True)
    with pytest.raises(PlanError, match=rf"buffers\[{j}\] is one buffer for all its slots.*attn.weight") as info:
        attrs.evolve(plan, buffers=tuple(buffers),
                     device_bytes_buffers=sum(b.nbytes for b in buffers) + sum(c.device_bytes for c in plan.experts))
    assert info.value.name == f"buffers[{j}].shared"


def test_the_shared_mark_survives_json_and_a_bad_one_is_refused() -> None:
    plan = _plan()
    assert OffloadPlan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="shared must be True or False"):
        attrs.evolve(plan.buffers[0], shared=1)  # type: ignore[arg-type]  # what an untyped caller may pass


def test_an_expert_caches_parameters_are_not_counted_as_the_layers_copies() -> None:
    cached, whole = _plan(), _plan(expert_cache=False)
    # each layer: its attention weight (its experts are copied at their call), against its
    # three tensors streamed whole (no host blocks on this snapshot: one copy each)
    assert layer_copies(cached) == (1,) * 6
    assert layer_copies(whole) == (3,) * 6


def test_the_plan_shows_which_buffers_are_one_for_all_slots() -> None:
    text = render_plan(_plan())
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("attn.", "mlp."))}
    assert "one buffer (expert rows)" in rows[EXPERTS[0]] and "one buffer" in rows[EXPERTS[1]]
    assert "one buffer" not in rows["attn.weight"]


@settings(max_examples=200, deadline=None)
@given(spec=moe_specs(), group=st.integers(1, 5), share=st.integers(1, 5), depth=st.integers(1, 5),
       slots=st.one_of(st.none(), st.integers(1, 2)), cache=st.booleans())
def test_every_prefetched_experts_module_has_one_cache_and_the_device_bytes_add_up(
        spec: ModelSpec, group: int, share: int, depth: int, slots: int | None, cache: bool) -> None:
    """For any MoE model and prefetch config: a cache per prefetched experts module and none
    else, each of C slots (1 to E) over exactly its module's parameters, all prefetched; a
    key is one buffer for all slots exactly when every prefetched owner of it is served by
    a cache; the device bytes are the buffers (shared ones once) and the caches; the plan
    survives JSON."""
    share = min(share, group)
    smallest = min((g.num_experts for g in spec.experts), default=2)
    plan = _plan(spec, group_size=group, num_in_group=share, prefetch_step=depth, expert_cache=cache,
                 expert_slots=None if slots is None else min(slots, smallest))
    prefetched = {(p.layer, p.name) for p in plan.params if p.placement is Placement.PREFETCH}
    expected = [g for g in spec.experts if cache and all((g.layer, n) in prefetched for n in g.params)]
    assert [c.group for c in plan.experts] == expected
    for c in plan.experts:
        assert 1 <= c.slots <= c.group.num_experts
        assert c.slots == (min(slots, smallest) if slots is not None else max(1, c.group.num_experts // 8))
    served = {(c.layer, n) for c in plan.experts for n in c.group.params}
    owners: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], set[bool]] = {}
    for p in plan.params:
        if p.placement is Placement.PREFETCH and p.tied_to is None:
            owners.setdefault(p.param.buffer_key, set()).add((p.layer, p.name) in served)
    for key, kinds in owners.items():
        buffer = next((b for b in plan.buffers if (b.name, b.shape, b.stride, b.dtype) == key), None)
        if buffer is not None:
            assert buffer.shared is (kinds == {True})
    assert plan.device_bytes_buffers == sum(b.nbytes for b in plan.buffers) + sum(c.device_bytes for c in plan.experts)
    assert all(b.nbytes == (b.slot_bytes if b.shared else b.slot_bytes * len(b.slots)) for b in plan.buffers)
    assert OffloadPlan.from_json(plan.to_json()) == plan
