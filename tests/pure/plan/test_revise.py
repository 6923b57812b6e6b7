"""revise_plan: the plan after post-processing replaced or deleted offloaded parameters."""

from __future__ import annotations

import attrs
import pytest

from offload import (
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    Placement,
    Platform,
    WarningCode,
    check_schedule,
    make_plan,
)
from offload.pure import contiguous_stride
from offload.pure.plan.revise import demote_to_on_demand, revise_plan

GPU = EnvSnapshot(platform=Platform(has_cuda=True, device_total_bytes=1 << 40, can_map_host_memory=True))


def p(name: str, *shape: int, dtype: str = "float32", itemsize: int = 4, key: str | None = None) -> ParamSpec:
    return ParamSpec(name=name, shape=shape, stride=contiguous_stride(shape), dtype=dtype, itemsize=itemsize,
                     storage_key=key, device="cuda:0")


def spec(layers: int) -> ModelSpec:
    return ModelSpec(layers=tuple(
        LayerSpec(index=i, name=f"l{i}", params=(p("w", 8, 4), p("b", 8), p("extra", 2)))
        for i in range(layers)
    ))


def prefetch_plan(layers: int = 5, step: int = 2) -> OffloadPlan:
    return make_plan(spec(layers), OffloadConfig(group_size=1, prefetch_step=step), GPU)


def find(plan: OffloadPlan, layer: int, name: str) -> list[Placement]:
    return [q.placement for q in plan.params if (q.layer, q.name) == (layer, name)]


def test_nothing_changed_returns_the_same_plan() -> None:
    plan = prefetch_plan()
    same = {(q.layer, q.name): q.param for q in plan.offloaded_params}
    assert revise_plan(plan, same) is plan
    assert revise_plan(plan, {}) is plan


def test_a_storage_key_change_alone_is_not_a_change() -> None:
    # The executor reports host storage keys; the identity of storage is not a shape change.
    plan = prefetch_plan()
    moved = {(q.layer, q.name): attrs.evolve(q.param, storage_key=f"host{q.layer}{q.name}")
             for q in plan.offloaded_params}
    assert revise_plan(plan, moved) is plan


def test_new_shape_and_dtype_reshape_buffers_and_totals() -> None:
    plan = prefetch_plan(layers=4, step=2)
    new_w = p("w", 16, 4, dtype="bfloat16", itemsize=2)
    revised = revise_plan(plan, {(1, "w"): new_w, (3, "w"): new_w})
    assert WarningCode.PLAN_REVISED in revised.warning_codes()
    message = next(w.message for w in revised.warnings if w.code is WarningCode.PLAN_REVISED)
    assert "1:w float32[8, 4] -> bfloat16[16, 4]" in message
    entry = next(q for q in revised.params if (q.layer, q.name) == (1, "w"))
    assert (entry.shape, entry.dtype, entry.device) == ((16, 4), "bfloat16", "cuda:0")
    keys = {b.key: b for b in revised.buffers}
    # Layers 0 and 2 keep the old key in slot 0; layers 1 and 3 use the new one in slot 1.
    assert keys[("w", (8, 4), (4, 1), "float32")].slots == (0,)
    assert keys[("w", (16, 4), (4, 1), "bfloat16")].slots == (1,)
    per_layer = 8 * 4 * 4 + 8 * 4 + 2 * 4
    assert revised.offloaded_bytes == plan.offloaded_bytes - 2 * 8 * 4 * 4 + 2 * 16 * 4 * 2
    assert revised.offloaded_bytes == 4 * per_layer - 2 * 128 + 2 * 128
    assert revised.device_bytes_freed == revised.offloaded_bytes == revised.host_bytes
    assert revised.device_bytes_buffers == sum(b.nbytes for b in revised.buffers)
    assert OffloadPlan.from_json(revised.to_json()) == revised


def test_deleted_parameters_are_dropped() -> None:
    plan = prefetch_plan(layers=3, step=1)
    revised = revise_plan(plan, {(i, "extra"): None for i in range(3)})
    assert all(q.name != "extra" for q in revised.params)
    assert len(revised.params) == len(plan.params) - 3
    assert revised.offloaded_bytes == plan.offloaded_bytes - 3 * 8
    assert all(b.name != "extra" for b in revised.buffers)
    assert "0:extra deleted" in next(w.message for w in revised.warnings if w.code is WarningCode.PLAN_REVISED)


def test_a_layer_that_loses_every_offloaded_parameter_leaves_the_schedule() -> None:
    plan = prefetch_plan(layers=4, step=2)
    gone = {(1, name): None for name in ("w", "b", "extra")}
    revised = revise_plan(plan, gone)
    assert revised.offloaded_layers == (0, 2, 3)
    assert revised.schedule.num_positions == 3
    check_schedule(revised.schedule)
    slots = {q.layer: q.slot for q in revised.params if q.placement is Placement.PREFETCH}
    assert slots == {0: revised.schedule.slots[0], 2: revised.schedule.slots[1], 3: revised.schedule.slots[2]}


def test_a_broken_tie_stores_each_member_on_its_own() -> None:
    tied = ModelSpec(layers=(LayerSpec(index=0, name="l0", params=(p("a", 4, key="k"), p("b", 4, key="k"))),))
    plan = make_plan(tied, OffloadConfig(group_size=1), GPU)
    b = next(q for q in plan.params if q.name == "b")
    assert b.tied_to == (0, "a")
    assert plan.offloaded_bytes == 16
    revised = revise_plan(plan, {(0, "a"): p("a", 4, key="new-a"), (0, "b"): p("b", 4, key="old")})
    assert next(q for q in revised.params if q.name == "b").tied_to is None
    assert revised.offloaded_bytes == 32
    assert revised.device_bytes_buffers == 32
    message = next(w.message for w in revised.warnings if w.code is WarningCode.PLAN_REVISED)
    assert "0:b no longer shares storage with 0:a" in message


def test_a_kept_tie_is_kept() -> None:
    tied = ModelSpec(layers=(LayerSpec(index=0, name="l0", params=(p("a", 4, key="k"), p("b", 4, key="k"))),))
    plan = make_plan(tied, OffloadConfig(group_size=1), GPU)
    revised = revise_plan(plan, {(0, "a"): p("a", 8, key="h"), (0, "b"): p("b", 8, key="h")})
    assert next(q for q in revised.params if q.name == "b").tied_to == (0, "a")
    assert revised.offloaded_bytes == 32
    assert revised.device_bytes_buffers == 32


@pytest.mark.parametrize("has_cuda", [True, False])
def test_device_bytes_freed_stays_zero_without_an_accelerator(has_cuda: bool) -> None:
    device = "cuda:0" if has_cuda else "cpu"
    model = ModelSpec(layers=tuple(
        LayerSpec(index=i, name=f"l{i}", params=tuple(attrs.evolve(q, device=device) for q in layer.params))
        for i, layer in enumerate(spec(2).layers)
    ))
    plan = make_plan(model, OffloadConfig(uva_max_bytes=1 << 30), GPU if has_cuda else EnvSnapshot())
    revised = revise_plan(plan, {(0, "extra"): None})
    assert revised.offloaded_bytes == plan.offloaded_bytes - 8
    assert revised.device_bytes_freed == (revised.offloaded_bytes if has_cuda else 0)
    assert find(revised, 0, "extra") == []


def test_demote_to_on_demand_changes_only_named_uva_parameters() -> None:
    plan = make_plan(spec(2), OffloadConfig(uva_max_bytes=1 << 30), GPU)
    assert {q.placement for q in plan.offloaded_params} == {Placement.UVA}
    demoted = demote_to_on_demand(plan, {(1, "w"), (0, "missing")}, "pinning failed")
    changed = [(q.layer, q.name) for q, r in zip(plan.params, demoted.params, strict=True) if q != r]
    assert changed == [(1, "w")]
    assert next(q for q in demoted.params if (q.layer, q.name) == (1, "w")).placement is Placement.ON_DEMAND
    message = next(w.message for w in demoted.warnings if w.code is WarningCode.PLAN_REVISED)
    assert message.startswith("pinning failed: 1:w copied to the device on demand")
    assert (demoted.offloaded_bytes, demoted.host_bytes) == (plan.offloaded_bytes, plan.host_bytes)
    assert demote_to_on_demand(plan, set(), "x") is plan
    assert demote_to_on_demand(prefetch_plan(), {(0, "w")}, "x") == prefetch_plan()
