"""`render_plan`: decisions with reasons, a table, totals in GiB, warnings."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import given, settings

from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    Platform,
    make_plan,
    render_plan,
)
from tests.pure.strategies import env_snapshots, model_specs, offload_configs, row_major

GIB = 1 << 30
GPU = Platform(has_cuda=True, device_name="Test GPU 80GB", device_total_bytes=80 * GIB, can_map_host_memory=True)


def _spec() -> ModelSpec:
    """12 layers of 1 GiB + 0.25 GiB in bf16: shapes only, so nothing is allocated."""
    big = (1 << 14, 1 << 15)  # 2**29 elements = 1 GiB in bf16
    small = (1 << 13, 1 << 14)  # 2**27 elements = 0.25 GiB
    params = (
        ParamSpec(name="mlp.up.weight", shape=big, stride=row_major(big), dtype="bfloat16", itemsize=2),
        ParamSpec(name="self_attn.q_proj.weight", shape=small, stride=row_major(small), dtype="bfloat16", itemsize=2),
    )
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"model.layers.{i}", params=params) for i in range(12)))


PLANS: list[tuple[str, OffloadConfig, EnvSnapshot]] = [
    ("prefetch", OffloadConfig(group_size=4, num_in_group=1, prefetch_step=2), EnvSnapshot(platform=GPU)),
    ("prefetch unpinned", OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1),
     EnvSnapshot(flags=EnvFlags(disable_pin_memory=True), platform=GPU)),
    ("uva", OffloadConfig(uva_max_bytes=5 * GIB + GIB // 2), EnvSnapshot(platform=GPU)),
    ("uva filtered", OffloadConfig(uva_max_bytes=3 * GIB, param_filter=("q_proj",)), EnvSnapshot(platform=GPU)),
    ("none", OffloadConfig(backend="none"), EnvSnapshot(platform=GPU)),
    ("cpu", OffloadConfig(group_size=3), EnvSnapshot()),
]

_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.])")


def _has_gib(line: str, nbytes: int) -> bool:
    """True when the line shows `nbytes` in GiB, to the precision the line prints."""
    for text in _NUMBER.findall(line):
        decimals = len(text.split(".")[1])
        if abs(float(text) - nbytes / GIB) <= 0.5 * 10**-decimals + 1e-12:
            return True
    return False


def _plan(config: OffloadConfig, env: EnvSnapshot) -> OffloadPlan:
    return make_plan(_spec(), config, env)


@pytest.mark.parametrize(("config", "env"), [c[1:] for c in PLANS], ids=[c[0] for c in PLANS])
def test_render_names_the_backend_and_the_reasons(config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = _plan(config, env)
    text = render_plan(plan)
    assert plan.backend.value in text
    assert plan.pin.explanation in text
    assert plan.uva.explanation in text
    for warning in plan.warnings:
        assert warning.message in text


@pytest.mark.parametrize(("config", "env"), [c[1:] for c in PLANS], ids=[c[0] for c in PLANS])
def test_render_totals_are_in_gib_and_match_the_plan(config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = _plan(config, env)
    text = render_plan(plan)
    assert "GiB" in text
    lines = text.splitlines()
    totals = {
        "offloaded": plan.offloaded_bytes,
        "host": plan.host_bytes,
        "freed": plan.device_bytes_freed,
        "buffers": plan.device_bytes_buffers,
        "resident": plan.device_bytes_resident,
    }
    for label, nbytes in totals.items():
        assert any(label in line.lower() and _has_gib(line, nbytes) for line in lines), (label, nbytes)


def test_the_prefetch_numbers_are_the_expected_ones() -> None:
    # Computed by hand: layers 3, 7, 11 of 12 offloaded, 1.25 GiB each; two slots.
    plan = _plan(PLANS[0][1], PLANS[0][2])
    assert plan.offloaded_layers == (3, 7, 11)
    assert plan.offloaded_bytes == 3 * (GIB + GIB // 4)
    assert plan.device_bytes_buffers == 2 * (GIB + GIB // 4)
    assert plan.device_bytes_resident == 9 * (GIB + GIB // 4)
    lines = render_plan(plan).splitlines()
    assert any("offloaded" in line and _has_gib(line, 3 * (GIB + GIB // 4)) for line in lines)
    assert any("buffers" in line and _has_gib(line, 2 * (GIB + GIB // 4)) for line in lines)


def test_render_says_how_many_copies_a_step_makes() -> None:
    # By hand: each offloaded layer's two weights (1 GiB and 0.25 GiB, dense) share a block
    # and an arena, so each layer is one copy; with layer_blocks "never", two. Layers 3, 7
    # and 11 use slots 0, 1, 0: layer 7 is alone in slot 1, copied once at the start and
    # never per step, so a step copies layers 3 and 11 only.
    config, env = PLANS[0][1], PLANS[0][2]
    merged = [line for line in render_plan(_plan(config, env)).splitlines() if line.startswith("copies:")]
    assert merged == ["copies:   2 per step (+1 loaded once: layer 7 has a slot of its own); 3 of 3 offloaded layers "
                      "are one copy each (layer_blocks auto, weights where they are now)"]
    never = render_plan(_plan(attrs.evolve(config, layer_blocks="never"), env))
    assert ("copies:   4 per step (+2 loaded once: layer 7 has a slot of its own); 0 of 3 offloaded layers are one "
            "copy each (layer_blocks never") in never
    assert not any(line.startswith("copies:") for line in render_plan(_plan(PLANS[2][1], PLANS[2][2])).splitlines())
    # Layers 1, 3, 5, ... (group 2) at depth 1 share slot 0: nothing is loaded once.
    shared = render_plan(_plan(OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1), EnvSnapshot(platform=GPU)))
    assert ("copies:   6 per step; 6 of 6 offloaded layers are one copy each (layer_blocks auto, weights where "
            "they are now)") in shared.splitlines()
    # Depth 3 for layers 3, 7, 11: a slot each, all loaded once.
    covering = render_plan(_plan(attrs.evolve(config, prefetch_step=3), env))
    assert ("copies:   0 per step (+3 loaded once: layers 3, 7, 11 have slots of their own); 3 of 3 offloaded "
            "layers are one copy each") in covering
    # Many kept layers are counted, not listed: 12 layers, each in a slot of its own.
    every = render_plan(_plan(OffloadConfig(group_size=1, prefetch_step=12), env))
    assert "copies:   0 per step (+12 loaded once: 12 layers have slots of their own); 12 of 12" in every


def test_render_says_what_is_offloaded_per_layer() -> None:
    plan = _plan(PLANS[0][1], PLANS[0][2])
    per_param = render_plan(plan, per_param=True)
    for p in plan.params:
        assert p.name in per_param
    # Offloaded and resident layers are told apart.
    assert "prefetch" in render_plan(plan)
    assert "resident" in render_plan(plan)


def test_the_warnings_section_is_there_exactly_when_there_are_warnings() -> None:
    quiet = _plan(OffloadConfig(backend="none"), EnvSnapshot(platform=GPU))
    assert quiet.warnings == ()
    noisy = _plan(OffloadConfig(group_size=2, num_in_group=2, prefetch_step=1),
                  EnvSnapshot(flags=EnvFlags(disable_pin_memory=True), platform=GPU))
    assert noisy.warnings
    assert "warning" not in render_plan(quiet).lower()
    assert "warning" in render_plan(noisy).lower()


@settings(max_examples=40, deadline=None)
@given(model_specs(max_layers=6), offload_configs(), env_snapshots())
def test_render_is_deterministic_and_shows_every_warning(spec: ModelSpec, config: OffloadConfig,
                                                         env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    text = render_plan(plan)
    assert text == render_plan(make_plan(spec, config, env))
    assert plan.backend.value in text
    for warning in plan.warnings:
        assert warning.message in text
