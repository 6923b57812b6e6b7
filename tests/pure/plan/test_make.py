"""`make_plan`: selection rules, ties, warnings, invariants and JSON.

Known cases are tables; the invariants are hypothesis properties checked against small
oracles written here from the planner's rules (which parameters may leave the compute
device, which layers prefetch takes, how the UVA budget is spent), not from the code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from offload.errors import OffloadError, PlanError
from offload.pure import (
    Backend,
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamPlan,
    ParamSpec,
    Placement,
    Platform,
    WarningCode,
    make_plan,
    render_plan,
    schedule_prefetch,
)
from offload.pure.decide.moves import Move
from tests.pure.strategies import env_snapshots, model_specs, offload_configs, row_major

GPU = Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=1000, can_map_host_memory=True)
CPU = Platform()
ON_GPU = EnvSnapshot(platform=GPU)
ON_CPU = EnvSnapshot(platform=CPU)


def param(name: str, elements: int = 64, *, dtype: str = "float16", itemsize: int = 2,
          device: str = "compute", key: str | None = None) -> ParamSpec:
    """A 1-D parameter of `elements` elements (so `elements * itemsize` bytes)."""
    return ParamSpec(name=name, shape=(elements,), stride=(1,), dtype=dtype, itemsize=itemsize,
                     device=device, storage_key=key)


def model(*layers: list[ParamSpec]) -> ModelSpec:
    return ModelSpec(layers=tuple(
        LayerSpec(index=i, name=f"model.layers.{i}", params=tuple(ps)) for i, ps in enumerate(layers)
    ))


def uniform(num_layers: int, *names: str, elements: int = 64) -> ModelSpec:
    return model(*([param(n, elements) for n in names] for _ in range(num_layers)))


def placements(plan: OffloadPlan) -> dict[tuple[int, str], Placement]:
    return {(p.layer, p.name): p.placement for p in plan.params}


def offloaded_refs(plan: OffloadPlan) -> set[tuple[int, str]]:
    return {(p.layer, p.name) for p in plan.params if p.placement is not Placement.RESIDENT}


def find(plan: OffloadPlan, layer: int, name: str) -> ParamPlan:
    (found,) = [p for p in plan.params if p.layer == layer and p.name == name]
    return found


# ============================================================================ selection

PREFETCH_LAYERS: list[tuple[int, int, int, tuple[int, ...]]] = [
    (16, 8, 2, (6, 7, 14, 15)),
    (20, 8, 2, (6, 7, 14, 15)),
    (24, 8, 2, (6, 7, 14, 15, 22, 23)),
    (10, 4, 1, (3, 7)),
    (4, 4, 1, (3,)),
    (3, 4, 1, ()),
    (8, 1, 1, (0, 1, 2, 3, 4, 5, 6, 7)),
    (6, 3, 3, (0, 1, 2, 3, 4, 5)),
    (7, 2, 1, (1, 3, 5)),
    (9, 3, 2, (1, 2, 4, 5, 7, 8)),
]


@pytest.mark.parametrize(("num_layers", "group", "num", "expected"), PREFETCH_LAYERS)
def test_prefetch_offloads_the_last_layers_of_each_group(
    num_layers: int, group: int, num: int, expected: tuple[int, ...]
) -> None:
    spec = uniform(num_layers, "mlp.up.weight", "mlp.down.weight")
    plan = make_plan(spec, OffloadConfig(group_size=group, num_in_group=num), ON_GPU)
    assert plan.backend is Backend.PREFETCH
    assert plan.offloaded_layers == expected
    for p in plan.params:
        assert (p.placement is Placement.PREFETCH) == (p.layer in expected)
    assert plan.offloaded_bytes == len(expected) * 2 * 128


@pytest.mark.parametrize(
    ("num_layers", "step", "slots"),
    [(16, 1, (0, 0, 0, 0)), (16, 2, (0, 1, 0, 1)), (24, 3, (0, 1, 2, 0, 1, 2)), (16, 8, (0, 1, 2, 3))],
)
def test_prefetch_slots_follow_the_schedule(num_layers: int, step: int, slots: tuple[int, ...]) -> None:
    spec = uniform(num_layers, "w")
    plan = make_plan(spec, OffloadConfig(group_size=8, num_in_group=2, prefetch_step=step), ON_GPU)
    assert plan.schedule.slots == slots
    assert tuple(find(plan, layer, "w").slot for layer in plan.offloaded_layers) == slots
    (buffer,) = plan.buffers
    assert buffer.slots == tuple(sorted(set(slots)))
    assert plan.device_bytes_buffers == len(set(slots)) * 128


# sizes in bytes of consecutive parameters (one per layer), budget, how many are taken
UVA_BUDGETS: list[tuple[list[int], int, int]] = [
    ([100] * 6, 1, 1),
    ([100] * 6, 100, 1),
    ([100] * 6, 101, 2),
    ([100] * 6, 250, 3),
    ([100] * 6, 600, 6),
    ([100] * 6, 10**12, 6),
    ([40, 400, 4, 4000], 41, 2),
    ([40, 400, 4, 4000], 444, 3),
    ([40, 400, 4, 4000], 445, 4),
    ([4000, 2, 2], 10, 1),
]


@pytest.mark.parametrize(("sizes", "budget", "taken"), UVA_BUDGETS)
def test_uva_spends_the_budget_in_layer_order_and_the_last_may_cross(sizes: list[int], budget: int, taken: int) -> None:
    spec = model(*[[param("w", size // 2)] for size in sizes])
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=budget), ON_GPU)
    assert plan.backend is Backend.UVA
    assert [p.placement is Placement.UVA for p in plan.params] == [i < taken for i in range(len(sizes))]
    assert plan.offloaded_bytes == sum(sizes[:taken])
    assert plan.host_bytes == sum(sizes[:taken])
    assert plan.buffers == ()


def test_uva_budget_spans_layers_param_by_param() -> None:
    spec = model([param("a", 50), param("b", 50)], [param("a", 50), param("b", 50)])
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=250), ON_GPU)
    assert offloaded_refs(plan) == {(0, "a"), (0, "b"), (1, "a")}


FILTER_NAMES = ("mlp.experts.w2_weight", "mlp.experts.w2_weight_scale", "mlp.shared_experts.w2_weight",
                "self_attn.q_proj.weight")
FILTERS: list[tuple[tuple[str, ...], set[str]]] = [
    (("experts.w2_weight",), {"mlp.experts.w2_weight"}),
    (("w2_weight",), {"mlp.experts.w2_weight", "mlp.shared_experts.w2_weight"}),
    (("experts",), {"mlp.experts.w2_weight", "mlp.experts.w2_weight_scale"}),
    (("q_proj", "w2_weight_scale"), {"self_attn.q_proj.weight", "mlp.experts.w2_weight_scale"}),
    (("weight",), {"self_attn.q_proj.weight"}),
    (("mlp",), {"mlp.experts.w2_weight", "mlp.experts.w2_weight_scale", "mlp.shared_experts.w2_weight"}),
]


@pytest.mark.parametrize("config", [OffloadConfig(group_size=1), OffloadConfig(uva_max_bytes=10**9)],
                         ids=["prefetch", "uva"])
@pytest.mark.parametrize(("segments", "names"), FILTERS)
def test_filter_matches_whole_segments(config: OffloadConfig, segments: tuple[str, ...], names: set[str]) -> None:
    spec = uniform(3, *FILTER_NAMES)
    plan = make_plan(spec, attrs.evolve(config, param_filter=segments), ON_GPU)
    assert offloaded_refs(plan) == {(layer, n) for layer in range(3) for n in names}
    assert WarningCode.FILTER_MATCHED_NOTHING not in plan.warning_codes()


def test_a_layer_without_a_match_stays_resident() -> None:
    spec = model(
        [param("mlp.experts.w2_weight"), param("norm.weight")],
        [param("norm.weight")],
        [param("mlp.experts.w2_weight"), param("norm.weight")],
        [param("norm.weight")],
    )
    plan = make_plan(spec, OffloadConfig(group_size=1, prefetch_step=1, param_filter=("experts.w2_weight",)), ON_GPU)
    assert plan.offloaded_layers == (0, 2)
    assert plan.schedule == schedule_prefetch(2, 1)
    for p in plan.params:
        if p.layer in (1, 3) or p.name == "norm.weight":
            assert p.placement is Placement.RESIDENT
            assert p.slot is None
    assert offloaded_refs(plan) == {(0, "mlp.experts.w2_weight"), (2, "mlp.experts.w2_weight")}


def _devices_spec() -> ModelSpec:
    return model([param("on_host", 50, device="cpu"), param("on_gpu", 100, device="cuda:0"),
                  param("unloaded", 150, device="compute")])


@pytest.mark.parametrize("config", [OffloadConfig(group_size=1), OffloadConfig(uva_max_bytes=10**9)],
                         ids=["prefetch", "uva"])
def test_cuda_platform_offloads_host_parameters_too(config: OffloadConfig) -> None:
    # A model loaded on the host and planned for a GPU: its weights go to the device or
    # to host copies like any other (it used to offload nothing, silently).
    plan = make_plan(_devices_spec(), config, ON_GPU)
    assert offloaded_refs(plan) == {(0, "on_host"), (0, "on_gpu"), (0, "unloaded")}
    assert plan.offloaded_bytes == plan.host_bytes == plan.device_bytes_freed == 100 + 200 + 300
    assert plan.device_bytes_resident == 0


@pytest.mark.parametrize("config", [OffloadConfig(group_size=1, keep_host_params=True),
                                    OffloadConfig(uva_max_bytes=10**9, keep_host_params=True)],
                         ids=["prefetch", "uva"])
def test_keep_host_params_leaves_host_parameters_alone_and_does_not_count_them(config: OffloadConfig) -> None:
    plan = make_plan(_devices_spec(), config, ON_GPU)
    assert find(plan, 0, "on_host").placement is Placement.RESIDENT
    assert offloaded_refs(plan) == {(0, "on_gpu"), (0, "unloaded")}
    assert plan.offloaded_bytes == 200 + 300
    assert plan.host_bytes == 500
    assert plan.device_bytes_freed == 500
    assert plan.device_bytes_resident == 0  # the host parameter is not on the device
    assert plan.move_of(find(plan, 0, "on_host")) is Move.KEEP
    (kept,) = [w for w in plan.warnings if w.code is WarningCode.HOST_PARAMS_KEPT]
    assert "1 parameters (0:on_host)" in kept.message
    assert WarningCode.HOST_PARAMS_KEPT not in make_plan(_devices_spec(), attrs.evolve(
        config, keep_host_params=False), ON_GPU).warning_codes()


def test_keep_host_params_is_ignored_without_an_accelerator() -> None:
    # Without an accelerator the host is the compute device: there is nothing to keep apart.
    plan = make_plan(_devices_spec(), OffloadConfig(group_size=1, keep_host_params=True), ON_CPU)
    assert (0, "on_host") in offloaded_refs(plan)


def test_host_parameters_do_not_spend_the_uva_budget_with_keep_host_params() -> None:
    plan = make_plan(_devices_spec(), OffloadConfig(uva_max_bytes=1, keep_host_params=True), ON_GPU)
    assert offloaded_refs(plan) == {(0, "on_gpu")}
    assert plan.offloaded_bytes == 200


def test_host_parameters_spend_the_uva_budget_in_layer_order() -> None:
    plan = make_plan(_devices_spec(), OffloadConfig(uva_max_bytes=1), ON_GPU)
    assert offloaded_refs(plan) == {(0, "on_host")}
    assert plan.offloaded_bytes == 100


def test_resident_host_parameters_count_as_device_bytes_unless_kept_on_the_host() -> None:
    spec = model([param("a", 100, device="cuda:0"), param("b", 50, device="cpu")], [param("a", 100, device="cuda:0")])
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=1), ON_GPU)
    assert offloaded_refs(plan) == {(0, "a")}
    assert plan.device_bytes_resident == 100 + 200  # b (fp16: 50 x 2 bytes) moves to the device
    assert plan.move_of(find(plan, 0, "b")) is Move.TO_DEVICE
    kept = make_plan(spec, OffloadConfig(uva_max_bytes=1, keep_host_params=True), ON_GPU)
    assert kept.device_bytes_resident == 200


@pytest.mark.parametrize("config", [OffloadConfig(group_size=1), OffloadConfig(uva_max_bytes=10**9)],
                         ids=["prefetch", "uva"])
def test_cpu_platform_offloads_cpu_parameters_and_frees_no_device_memory(config: OffloadConfig) -> None:
    plan = make_plan(_devices_spec(), config, EnvSnapshot(platform=CPU))
    assert find(plan, 0, "on_host").offloaded
    assert find(plan, 0, "unloaded").offloaded
    assert plan.offloaded_bytes >= 100 + 300
    assert plan.host_bytes == plan.offloaded_bytes
    assert plan.device_bytes_freed == 0
    assert plan.device_bytes_saved == 0
    assert WarningCode.NO_ACCELERATOR in plan.warning_codes()


# ---------------------------------------------------------------------------- ties

TIE_CONFIGS = [OffloadConfig(group_size=1), OffloadConfig(group_size=1, prefetch_step=2),
               OffloadConfig(uva_max_bytes=10**9)]


def test_tied_parameters_across_layers_are_offloaded_once_by_uva() -> None:
    spec = model([param("embed.weight", 500, key="emb"), param("w", 50)],
                 [param("w", 50), param("lm_head.weight", 500, key="emb")])
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=10**9), ON_GPU)
    assert offloaded_refs(plan) == {(0, "embed.weight"), (0, "w"), (1, "w"), (1, "lm_head.weight")}
    assert plan.offloaded_bytes == 1000 + 100 + 100
    assert plan.host_bytes == 1200
    assert find(plan, 1, "lm_head.weight").tied_to == (0, "embed.weight")
    assert find(plan, 0, "embed.weight").tied_to is None


@pytest.mark.parametrize("config", TIE_CONFIGS[:2], ids=["prefetch", "prefetch-2"])
def test_tied_parameters_across_layers_stay_resident_with_prefetch(config: OffloadConfig) -> None:
    # One parameter object cannot point at two layers' static buffers at once.
    spec = model([param("embed.weight", 500, key="emb"), param("w", 50)],
                 [param("w", 50), param("lm_head.weight", 500, key="emb")])
    plan = make_plan(spec, config, ON_GPU)
    assert offloaded_refs(plan) == {(0, "w"), (1, "w")}
    assert plan.offloaded_bytes == 100 + 100
    assert find(plan, 1, "lm_head.weight").placement is Placement.RESIDENT
    assert plan.device_bytes_resident == 1000
    tied = [w for w in plan.warnings if w.code is WarningCode.TIED_KEPT_RESIDENT]
    assert len(tied) == 1 and "0:embed.weight" in tied[0].message and "1:lm_head.weight" in tied[0].message


@pytest.mark.parametrize("config", TIE_CONFIGS, ids=["prefetch", "prefetch-2", "uva"])
def test_tied_parameters_in_one_layer_are_offloaded_once(config: OffloadConfig) -> None:
    spec = model([param("a.weight", 100, key="k"), param("b.weight", 100, key="k"), param("c", 10)])
    plan = make_plan(spec, config, ON_GPU)
    assert offloaded_refs(plan) == {(0, "a.weight"), (0, "b.weight"), (0, "c")}
    assert plan.offloaded_bytes == 200 + 20
    if plan.backend is Backend.PREFETCH:
        # One storage needs one static buffer in this layer, not two.
        assert plan.device_bytes_buffers == (200 + 20) * plan.schedule.num_slots


def test_tied_bytes_count_once_against_the_uva_budget() -> None:
    # If the tie counted twice (200 bytes), the budget of 150 would stop before "u".
    spec = model([param("t1", 50, key="k")], [param("t2", 50, key="k"), param("u", 50)], [param("v", 50)])
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=150), ON_GPU)
    assert offloaded_refs(plan) == {(0, "t1"), (1, "t2"), (1, "u")}
    assert plan.offloaded_bytes == 200


PARTIAL_TIES: list[tuple[str, ModelSpec, OffloadConfig]] = [
    ("one member in a resident layer",
     model([param("embed.weight", key="e")], [param("lm_head.weight", key="e"), param("w")]),
     OffloadConfig(group_size=2, num_in_group=1)),
    ("one member outside the filter",
     model([param("a.weight", key="k"), param("b.weight", key="k"), param("a.bias")]),
     OffloadConfig(uva_max_bytes=10**9, param_filter=("a",))),
]


@pytest.mark.parametrize(("spec", "config"), [c[1:] for c in PARTIAL_TIES], ids=[c[0] for c in PARTIAL_TIES])
def test_partially_eligible_ties_stay_resident_with_a_warning(spec: ModelSpec, config: OffloadConfig) -> None:
    plan = make_plan(spec, config, ON_GPU)
    keyed = {(layer.index, p.name) for layer in spec.layers for p in layer.params if p.storage_key}
    for ref in keyed:
        assert placements(plan)[ref] is Placement.RESIDENT
    # The untied parameter was still offloaded, so the tie's exclusion is the point.
    assert offloaded_refs(plan)
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.TIED_KEPT_RESIDENT]
    for _, name in keyed:
        assert name in warning.message


# ============================================================================ warnings

BASE_SPEC = uniform(8, "mlp.up.weight", "mlp.down.weight")  # 8 layers x 2 x 128 B = 2048 B
BASE_CONFIG = OffloadConfig(group_size=4, num_in_group=1, prefetch_step=1)  # layers 3 and 7


def _evolved(config: OffloadConfig | None = None, flags: EnvFlags | None = None, spec: ModelSpec | None = None,
             **platform: Any) -> tuple[ModelSpec, OffloadConfig, EnvSnapshot]:
    env = EnvSnapshot(flags=flags or EnvFlags(), platform=attrs.evolve(GPU, **platform))
    return spec or BASE_SPEC, config or BASE_CONFIG, env


CLEAN: list[tuple[str, tuple[ModelSpec, OffloadConfig, EnvSnapshot]]] = [
    ("prefetch", _evolved()),
    ("uva", _evolved(OffloadConfig(uva_max_bytes=300))),
    ("none", _evolved(OffloadConfig(backend="none"))),
    ("auto nothing", _evolved(OffloadConfig())),
    ("prefetch with a filter", _evolved(attrs.evolve(BASE_CONFIG, param_filter=("up",)))),
    ("enough host memory", _evolved(host_available_bytes=512, memlock_limit_bytes=512)),
    ("depth equals the run", _evolved(OffloadConfig(group_size=4, num_in_group=2, prefetch_step=2))),
]


@pytest.mark.parametrize("case", [c[1] for c in CLEAN], ids=[c[0] for c in CLEAN])
def test_clean_plans_have_no_warnings(case: tuple[ModelSpec, OffloadConfig, EnvSnapshot]) -> None:
    plan = make_plan(*case)
    assert plan.warnings == ()


WARNINGS: list[tuple[WarningCode, tuple[ModelSpec, OffloadConfig, EnvSnapshot], str]] = [
    (WarningCode.FILTER_MATCHED_NOTHING, _evolved(attrs.evolve(BASE_CONFIG, param_filter=("up", "nomatch_seg"))),
     "nomatch_seg"),
    (WarningCode.FILTER_MATCHED_NOTHING, _evolved(OffloadConfig(uva_max_bytes=5, param_filter=("zz_missing",))),
     "zz_missing"),
    (WarningCode.MODEL_FITS_ON_DEVICE, _evolved(device_total_bytes=1 << 30), ""),
    (WarningCode.PREFETCH_STALLS, _evolved(OffloadConfig(group_size=4, num_in_group=2, prefetch_step=1)), ""),
    (WarningCode.PREFETCH_STALLS, _evolved(OffloadConfig(group_size=8, num_in_group=3, prefetch_step=2)), ""),
    # Layers 3 and 7 at depth 2: a slot each, so each is loaded once and never copied again.
    (WarningCode.PREFETCH_DEPTH_COVERS_ALL, _evolved(attrs.evolve(BASE_CONFIG, prefetch_step=2)),
     "each is loaded once and keeps its slot, so nothing is copied per step"),
    (WarningCode.INTEGRATED_GPU, _evolved(is_integrated=True), ""),
    (WarningCode.PREFETCH_UNPINNED, _evolved(flags=EnvFlags(disable_pin_memory=True)), "6"),
    (WarningCode.PREFETCH_UNPINNED, _evolved(is_wsl=True), "graph"),
    (WarningCode.HOST_MEMORY_SHORT, _evolved(host_available_bytes=511), ""),
    (WarningCode.MEMLOCK_LIMIT, _evolved(memlock_limit_bytes=511), ""),
    (WarningCode.NO_ACCELERATOR, (BASE_SPEC, BASE_CONFIG, EnvSnapshot()), ""),
    # Room on the device for the pinned copies: the general warning. Without it (the GPU's
    # 1000 bytes hold less than the resident 1536), the admission check's numbers instead.
    (WarningCode.COHERENT_UNIFIED_MEMORY, _evolved(pageable_memory_access=True, pageable_uses_host_page_tables=True,
                                                   device_total_bytes=1 << 30), ""),
    (WarningCode.DEVICE_MEMORY_SHORT, _evolved(pageable_memory_access=True, pageable_uses_host_page_tables=True),
     "pinned"),
    (WarningCode.ON_DEMAND_SLOW, _evolved(OffloadConfig(uva_max_bytes=300), EnvFlags(disable_uva=True)), ""),
    (WarningCode.ON_DEMAND_SLOW, _evolved(OffloadConfig(uva_max_bytes=300), can_map_host_memory=False), ""),
    (WarningCode.BOTH_BACKENDS_CONFIGURED, _evolved(attrs.evolve(BASE_CONFIG, uva_max_bytes=300)), ""),
    (WarningCode.SETTINGS_UNUSED, _evolved(OffloadConfig(backend="uva", uva_max_bytes=300, group_size=4)), ""),
    (WarningCode.NOTHING_OFFLOADED, _evolved(OffloadConfig(group_size=16)), ""),
    (WarningCode.NOTHING_OFFLOADED, _evolved(attrs.evolve(BASE_CONFIG, param_filter=("zz_missing",))), ""),
    (WarningCode.TIED_KEPT_RESIDENT, _evolved(spec=model(
        [param("embed.weight", key="e")], [param("w")], [param("w")], [param("lm_head.weight", key="e"), param("w")],
    )), "lm_head.weight"),
    (WarningCode.HOST_PARAMS_KEPT, _evolved(attrs.evolve(BASE_CONFIG, keep_host_params=True), spec=model(
        [param("w", device="cpu")], [param("w", device="cuda:0")], [param("w")], [param("w")],
    )), "0:w"),
]


@pytest.mark.parametrize(("code", "case", "mentions"), WARNINGS, ids=[f"{w[0].value}-{i}" for i, w in enumerate(WARNINGS)])
def test_each_warning_in_a_case_built_for_it(
    code: WarningCode, case: tuple[ModelSpec, OffloadConfig, EnvSnapshot], mentions: str
) -> None:
    plan = make_plan(*case)
    found = [w for w in plan.warnings if w.code is code]
    assert len(found) == 1
    assert found[0].message.strip()
    assert mentions in found[0].message


def test_every_warning_code_has_a_case() -> None:
    # PLAN_REVISED comes from revise_plan, not make_plan (tests/pure/plan/test_revise.py);
    # DISK_BOUND from the disk tier's estimate (tests/pure/disk/test_estimate.py).
    assert {w[0] for w in WARNINGS} == set(WarningCode) - {WarningCode.PLAN_REVISED, WarningCode.DISK_BOUND}


def test_both_backends_configured_picks_prefetch() -> None:
    plan = make_plan(*_evolved(attrs.evolve(BASE_CONFIG, uva_max_bytes=300)))
    assert plan.backend is Backend.PREFETCH
    assert all(p.placement in (Placement.PREFETCH, Placement.RESIDENT) for p in plan.params)


def test_unpinned_prefetch_warning_says_why_it_matters() -> None:
    plan = make_plan(*_evolved(flags=EnvFlags(disable_pin_memory=True)))
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.PREFETCH_UNPINNED]
    assert "6" in warning.message
    assert "graph" in warning.message.lower()


def test_host_memory_short_names_both_sizes() -> None:
    plan = make_plan(*_evolved(host_available_bytes=100))
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
    assert "512" in warning.message or "0.5 KiB" in warning.message
    assert "100" in warning.message


# ============================================================================ properties
#
# Oracles: the planner's rules, restated.


def on_compute_device(device: str, platform: Platform, keep_host: bool = False) -> bool:
    """Eligible by device: not yet loaded (or meta, materialised on the compute device),
    on the host (moved to the compute device or offloaded from it) unless the config keeps
    host parameters on a CUDA platform, on CUDA when there is CUDA."""
    if device in ("compute", "meta"):
        return True
    if device == "cpu":
        return not (keep_host and platform.has_cuda)
    return platform.has_cuda and device.startswith("cuda")


Unit = list[tuple[int, ParamSpec]]


def storage_units(spec: ModelSpec) -> list[Unit]:
    """Parameters grouped by storage (tied ones together), in order of first appearance."""
    units: dict[object, Unit] = {}
    for layer in spec.layers:
        for p in layer.params:
            key: object = ("key", p.storage_key) if p.storage_key is not None else ("own", layer.index, p.name)
            units.setdefault(key, []).append((layer.index, p))
    return list(units.values())


def unit_bytes(unit: Unit) -> int:
    return unit[0][1].nbytes


def member_ok(layer: int, p: ParamSpec, config: OffloadConfig, env: EnvSnapshot, backend: Backend) -> bool:
    if not on_compute_device(p.device, env.platform, config.keep_host_params):
        return False
    if config.param_filter and not any(f".{s}." in f".{p.name}." for s in config.param_filter):
        return False
    if backend is Backend.PREFETCH:
        return layer % config.group_size >= config.group_size - config.num_in_group
    return True


def expected_offloaded(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot, backend: Backend) -> list[Unit]:
    if backend is Backend.NONE:
        return []
    whole = [u for u in storage_units(spec) if all(member_ok(i, p, config, env, backend) for i, p in u)]
    if backend is Backend.PREFETCH:
        # A storage shared by several layers stays resident with prefetch.
        return [u for u in whole if len({i for i, _ in u}) == 1]
    taken: list[Unit] = []
    total = 0
    for unit in whole:
        if total >= config.uva_max_bytes:
            break
        taken.append(unit)
        total += unit_bytes(unit)
    return taken


def expected_backend(config: OffloadConfig) -> Backend:
    if config.backend != "auto":
        return Backend(config.backend)
    if config.group_size > 0:
        return Backend.PREFETCH
    return Backend.UVA if config.uva_max_bytes > 0 else Backend.NONE


_PLAN_INPUTS = (model_specs(max_layers=9), offload_configs(), env_snapshots())


@settings(max_examples=100, deadline=None)
@given(*_PLAN_INPUTS)
def test_selection_follows_the_rules(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    backend = expected_backend(config)
    assert plan.backend is backend
    units = expected_offloaded(spec, config, env, backend)
    assert offloaded_refs(plan) == {(i, p.name) for u in units for i, p in u}
    expected_bytes = sum(unit_bytes(u) for u in units)
    assert plan.offloaded_bytes == expected_bytes
    assert plan.host_bytes == expected_bytes
    assert plan.device_bytes_freed == (expected_bytes if env.platform.has_cuda else 0)
    resident_units = [u for u in storage_units(spec) if u not in units]
    assert plan.device_bytes_resident == sum(
        unit_bytes(u) for u in resident_units
        if on_compute_device(u[0][1].device, env.platform, config.keep_host_params)
    )
    offloaded_placement = {
        Backend.PREFETCH: Placement.PREFETCH,
        Backend.UVA: Placement.UVA if plan.uva.enabled else Placement.ON_DEMAND,
        Backend.NONE: Placement.RESIDENT,
    }[backend]
    assert {p.placement for p in plan.offloaded_params} <= {offloaded_placement}
    assert plan.env_fingerprint == env.fingerprint()
    assert plan.config == config


@settings(max_examples=50, deadline=None)
@given(*_PLAN_INPUTS)
def test_equal_inputs_give_equal_plans(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    spec_twin = ModelSpec(layers=tuple(
        LayerSpec(index=layer.index, name=layer.name, params=tuple(attrs.evolve(p) for p in layer.params))
        for layer in spec.layers
    ))
    config_twin = attrs.evolve(config)
    env_twin = EnvSnapshot(flags=attrs.evolve(env.flags), platform=attrs.evolve(env.platform))
    first = make_plan(spec, config, env)
    second = make_plan(spec_twin, config_twin, env_twin)
    assert first == second
    assert hash(first) == hash(second)
    assert first.to_json() == second.to_json()


@settings(max_examples=50, deadline=None)
@given(*_PLAN_INPUTS)
def test_every_parameter_appears_exactly_once_in_order(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    expected = [(layer.index, p) for layer in spec.layers for p in layer.params]
    assert len(plan.params) == len(expected)
    for planned, (index, p) in zip(plan.params, expected, strict=True):
        assert (planned.layer, planned.name) == (index, p.name)
        assert planned.shape == p.shape
        assert planned.stride == p.stride
        assert planned.dtype == p.dtype
        assert planned.nbytes == p.nbytes
        assert (planned.slot is not None) == (planned.placement is Placement.PREFETCH)


@settings(max_examples=80, deadline=None)
@given(model_specs(max_layers=9), offload_configs(max_budget=3000), env_snapshots())
def test_uva_budget_holds(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    config = attrs.evolve(config, backend="uva", uva_max_bytes=max(config.uva_max_bytes, 1))
    plan = make_plan(spec, config, env)
    offloaded = [u for u in storage_units(spec) if (u[0][0], u[0][1].name) in offloaded_refs(plan)]
    total = plan.offloaded_bytes
    assert total == sum(unit_bytes(u) for u in offloaded)
    if offloaded:
        assert total < config.uva_max_bytes + max(unit_bytes(u) for u in offloaded)
    eligible = expected_offloaded(spec, attrs.evolve(config, uva_max_bytes=10**18), env, Backend.UVA)
    if total < config.uva_max_bytes:
        # Below the budget only when everything eligible was taken.
        assert len(offloaded) == len(eligible)
    # Taken in layer order: a prefix of the eligible storages.
    assert offloaded == eligible[: len(offloaded)]


@settings(max_examples=80, deadline=None)
@given(model_specs(min_layers=1, max_layers=10), offload_configs(), env_snapshots())
def test_prefetch_buffers_and_slots_are_consistent(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    config = attrs.evolve(config, backend="prefetch", group_size=max(config.group_size, config.num_in_group))
    plan = make_plan(spec, config, env)
    prefetched = [p for p in plan.params if p.placement is Placement.PREFETCH]
    layers = sorted({p.layer for p in prefetched})
    assert list(plan.offloaded_layers) == layers
    assert plan.schedule == schedule_prefetch(len(layers), config.prefetch_step)
    position = {layer: i for i, layer in enumerate(layers)}
    for p in prefetched:
        slot = p.slot
        assert slot is not None
        assert slot == plan.schedule.slots[position[p.layer]]
        assert slot < config.prefetch_step
    # device_bytes_buffers is the sum of the buffers' slots.
    assert plan.device_bytes_buffers == sum(b.slot_bytes * len(b.slots) for b in plan.buffers)
    keys = [(b.name, b.shape, b.stride, b.dtype) for b in plan.buffers]
    assert len(keys) == len(set(keys))
    by_key = {k: b for k, b in zip(keys, plan.buffers, strict=True)}
    # A parameter whose storage's first name (which holds the host copy) is in its own
    # layer reads that one's buffer; the others need their own.
    tied_in_layer = {(i, p.name) for u in storage_units(spec) for i, p in u[1:] if i == u[0][0]}
    used: set[tuple[object, int]] = set()
    for p in prefetched:
        if (p.layer, p.name) in tied_in_layer:
            continue  # reads the buffer of the earlier parameter of its storage
        key = (p.name, p.shape, p.stride, p.dtype)
        assert key in by_key
        assert p.slot in by_key[key].slots
        assert by_key[key].slot_bytes == p.nbytes
        used.add((key, p.slot))
    # No slot is allocated that no parameter uses, and no buffer has more than step slots.
    assert used == {(k, s) for k, b in by_key.items() for s in b.slots}
    assert all(len(b.slots) <= config.prefetch_step for b in plan.buffers)
    # No two parameters of one layer share a buffer key.
    for layer in layers:
        layer_keys = [(p.name, p.shape, p.stride, p.dtype) for p in prefetched
                      if p.layer == layer and (p.layer, p.name) not in tied_in_layer]
        assert len(layer_keys) == len(set(layer_keys))


@settings(max_examples=60, deadline=None)
@given(*_PLAN_INPUTS)
def test_json_round_trip(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    text = plan.to_json()
    assert OffloadPlan.from_json(text) == plan
    assert OffloadPlan.from_json(plan.to_json(indent=2)) == plan
    assert isinstance(json.loads(text), dict)


# ============================================================================ JSON junk


def _json_plan() -> dict[str, Any]:
    spec = uniform(6, "mlp.up.weight", "mlp.down.weight")
    plan = make_plan(spec, OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2), ON_GPU)
    assert plan.schedule.num_positions == 3  # layers 1, 3, 5: not a multiple of the step
    document = json.loads(plan.to_json())
    assert isinstance(document, dict)
    return document


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _set_first(key: str, value: Any, *, where: Callable[[dict[str, Any]], bool] = lambda _d: True
               ) -> Callable[[dict[str, Any]], None]:
    def tamper(document: dict[str, Any]) -> None:
        for node in _walk(document["plan"]):
            if key in node and where(node):
                node[key] = value
                return
        raise AssertionError(f"no {key!r} in the plan document")

    return tamper


def _plan_field(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def tamper(document: dict[str, Any]) -> None:
        assert key in document["plan"]
        document["plan"][key] = value

    return tamper


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def tamper(document: dict[str, Any]) -> None:
        del document["plan"][key]

    return tamper


def _naive_schedule(document: dict[str, Any]) -> None:
    # FACTS.md's trap: next = (i + s) mod n with n = 3, s = 2.
    (schedule,) = [n for n in _walk(document["plan"]) if "next_after" in n]
    schedule["next_after"] = [2, 0, 1]


def _is_prefetch(node: dict[str, Any]) -> bool:
    return node.get("placement") == "prefetch"


def _is_resident(node: dict[str, Any]) -> bool:
    return node.get("placement") == "resident"


TAMPERS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("slot that disagrees with the schedule", _set_first("slot", 1, where=_is_prefetch)),
    ("slot on a resident parameter", _set_first("slot", 0, where=_is_resident)),
    ("negative slot", _set_first("slot", -1, where=_is_prefetch)),
    ("unknown placement", _set_first("placement", "teleport")),
    ("shape is a string", _set_first("shape", "big")),
    ("shape has a negative size", _set_first("shape", [-4])),
    ("unknown backend", _plan_field("backend", "fast")),
    ("buffer total off by one", lambda d: d["plan"].__setitem__("device_bytes_buffers",
                                                                 d["plan"]["device_bytes_buffers"] + 1)),
    ("hazardous schedule", _naive_schedule),
    ("unknown field", lambda d: d["plan"].__setitem__("surprise", 1)),
    ("missing warnings", _drop("warnings")),
    ("missing params", _drop("params")),
    ("missing schedule", _drop("schedule")),
    ("fingerprint is a number", _plan_field("env_fingerprint", 5)),
    ("pin is a string", _set_first("pin", "yes", where=lambda n: "reason" in n)),
    ("bytes as a float", _plan_field("host_bytes", 1.5)),
    ("bytes as a bool", _plan_field("host_bytes", True)),
    ("invalid config inside", _set_first("group_size", -1)),
    ("num_in_group above group_size inside", _set_first("num_in_group", 99)),
]


@pytest.mark.parametrize("tamper", [t[1] for t in TAMPERS], ids=[t[0] for t in TAMPERS])
def test_from_json_rejects_tampered_plans(tamper: Callable[[dict[str, Any]], None]) -> None:
    document = _json_plan()
    untouched = OffloadPlan.from_json(json.dumps(document))
    assert untouched.offloaded_layers == (1, 3, 5)
    tamper(document)
    with pytest.raises(PlanError):
        OffloadPlan.from_json(json.dumps(document))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "{",
        "null",
        "42",
        '"offload-plan/1"',
        "[]",
        "{}",
        '{"plan": {}}',
        '{"format": "offload-plan/0", "plan": {}}',
        '{"format": "something-else", "plan": {}}',
        '{"format": "offload-plan/1"}',
        '{"format": "offload-plan/1", "plan": null}',
        '{"format": "offload-plan/1", "plan": []}',
        '{"format": "offload-plan/1", "plan": {}}',
        '{"format": "offload-plan/1", "plan": {"config": 5}}',
    ],
)
def test_from_json_rejects_junk(text: str) -> None:
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(text)
    assert isinstance(caught.value, OffloadError)


def test_wrong_format_names_the_format() -> None:
    document = _json_plan()
    document["format"] = "offload-plan/99"
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(json.dumps(document))
    assert "offload-plan/99" in str(caught.value)


def test_a_plan_written_before_lone_owners_were_loaded_once_still_reads_and_runs_the_same() -> None:
    # Layers 1, 3, 5 at depth 2 use slots 0, 1, 0: layer 3 is alone in slot 1. Plans written
    # before it was loaded once say next_after = [2, 1, 0] (copy layer 3 again after itself).
    document = _json_plan()
    (schedule,) = [n for n in _walk(document["plan"]) if "next_after" in n]
    assert schedule["next_after"] == [2, None, 0]
    new = OffloadPlan.from_json(json.dumps(document))
    schedule["next_after"] = [2, 1, 0]
    old = OffloadPlan.from_json(json.dumps(document))
    assert old.schedule.next_after == (2, 1, 0)
    assert old.schedule.kept_positions == new.schedule.kept_positions == {1}
    assert old.schedule.issued_after == new.schedule.issued_after == new.schedule.next_after
    assert render_plan(old) == render_plan(new)
    # Two 128-byte weights a layer (not a multiple of 256 bytes: one copy each); layers 1
    # and 5 every step, layer 3 once.
    assert "copies:   4 per step (+2 loaded once: layer 3 has a slot of its own)" in render_plan(old)


# ============================================================================ values


def test_plans_are_frozen() -> None:
    plan = make_plan(BASE_SPEC, BASE_CONFIG, ON_GPU)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.backend = Backend.NONE  # type: ignore[misc]
    assert isinstance(plan.params, tuple)
    assert isinstance(plan.buffers, tuple)
    assert isinstance(plan.warnings, tuple)


def test_non_contiguous_parameters_keep_their_strides_and_span() -> None:
    transposed = ParamSpec(name="w", shape=(8, 4), stride=(1, 8), dtype="int8", itemsize=1)
    sliced = ParamSpec(name="s", shape=(4, 3), stride=row_major((4, 5)), dtype="float8_e4m3fn", itemsize=1)
    plan = make_plan(model([transposed, sliced]), OffloadConfig(group_size=1), ON_GPU)
    assert find(plan, 0, "w").stride == (1, 8)
    assert find(plan, 0, "w").nbytes == 32
    assert find(plan, 0, "s").nbytes == 3 * 5 + 3  # rows 0..3 of 5, last row only 3 wide
    assert plan.offloaded_bytes == 32 + 18
