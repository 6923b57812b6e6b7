"""The disk tier's plan (`offload.pure.disk.tier`): for any prefetch plan and host budget,
the fewest last layers go to disk that make the host tier plus the staging ring fit;
every offloaded byte is in exactly one tier; the read order is the copies' order; a
checkpoint's parameters are read where they lie exactly when their bytes are the model's;
the value round-trips through JSON and refuses what breaks its rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import EnvSnapshot, OffloadConfig, PlanError, make_plan
from offload.model.checkpoint import checkpoint_extents, read_checkpoint
from offload.pure.disk.render import render_disk_tier
from offload.pure.disk.tier import (
    READ_BLOCK,
    DiskParam,
    DiskSource,
    DiskTierPlan,
    check_read_order,
    plan_disk_tier,
    staging_layout,
)
from offload.pure.plan.plan import OffloadPlan
from offload.pure.spec.extents import DiskExtent
from offload.pure.spec.presets import preset_spec
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes
from tests.hf.checkpoints import build, save
from tests.pure.strategies import model_specs


def _staged(plan: OffloadPlan, layer: int) -> int:
    """A spilled layer's owned parameters packed one after another, each on a 4 KiB
    boundary (as the spill file writes them: congruent)."""
    end = 0
    for p in plan.offloaded_params:
        if p.layer == layer and p.tied_to is None:
            end = -(-end // 4096) * 4096 + p.param.nbytes
    return end


def _host_with(plan: OffloadPlan, disk_layers: set[int], read_ahead: int) -> int:
    """Host bytes with `disk_layers` on disk: the plan's host copies less theirs, plus the ring."""
    on_disk = sum(p.param.nbytes for p in plan.offloaded_params if p.tied_to is None and p.layer in disk_layers)
    largest = max((_staged(plan, layer) for layer in disk_layers), default=0)
    ring = min(read_ahead, len(disk_layers)) * (largest + 4096) if largest else 0  # each buffer a block larger
    return plan.host_bytes - on_disk + ring


@settings(max_examples=150, deadline=None)
@given(spec=model_specs(min_layers=1, max_layers=10, devices=("compute",)), group=st.integers(1, 3),
       step=st.integers(1, 3), share=st.floats(0.0, 1.2), read_ahead=st.integers(1, 3))
def test_the_fewest_last_layers_go_to_disk_and_every_byte_is_in_one_tier(spec: ModelSpec, group: int, step: int,
                                                                          share: float, read_ahead: int) -> None:
    plan = make_plan(spec, OffloadConfig(group_size=group, prefetch_step=step), EnvSnapshot())
    budget = int(plan.host_bytes * share)
    positions = plan.offloaded_layers
    tied = {layer for p in plan.offloaded_params if p.tied_to is not None and p.tied_to[0] != p.layer
            for layer in (p.layer, p.tied_to[0])}
    candidates = [i for i in range(len(positions)) if i not in plan.schedule.kept_positions
                  and positions[i] not in tied]
    try:
        tier = plan_disk_tier(plan, host_budget_bytes=budget, disk_gbps=2.0, read_ahead=read_ahead)
    except PlanError as exc:
        assert exc.name == "host_budget_bytes"
        assert _host_with(plan, {positions[i] for i in candidates}, read_ahead) > budget  # not even all of them
        return
    assert tier.host_bytes <= budget
    assert tier.host_bytes == _host_with(plan, set(tier.disk_layers), read_ahead)
    count = len(tier.disk_positions)
    assert list(tier.disk_positions) == candidates[len(candidates) - count:]  # the last ones that can be
    if count:  # the fewest: one fewer does not fit
        fewer = {positions[i] for i in candidates[len(candidates) - count + 1:]}
        assert _host_with(plan, fewer, read_ahead) > budget
    # Every byte of the plan's host copies in exactly one tier.
    assert tier.host_tier_bytes + tier.disk_bytes == plan.host_bytes
    assert sorted((p.layer, p.name) for p in tier.params) == sorted(
        (p.layer, p.param.name) for p in plan.offloaded_params if p.tied_to is None and p.layer in tier.disk_layers)
    assert all(p.source is DiskSource.SPILL and p.reason == "no checkpoint" for p in tier.params)
    check_read_order(tier.read_order, plan.schedule.issued_after, tier.disk_positions)
    # Each disk layer's parameters lie apart in its staging buffer, each spilled one on a
    # 4 KiB boundary (congruent with the spill file).
    layout = staging_layout(tier)
    assert sorted(layout) == sorted(tier.disk_layers if tier.params else ())
    for layer, (offsets, end) in layout.items():
        layer_sizes = [p.nbytes for p in tier.params if p.layer == layer]
        assert all(offset % READ_BLOCK == 0 for offset in offsets)
        assert all(a + size <= b for a, size, b in zip(offsets, layer_sizes, offsets[1:], strict=False))
        assert end == offsets[-1] + layer_sizes[-1] <= tier.staging_bytes
    # Each read waits for the copy out of its buffer's previous occupant: an earlier read of
    # the same buffer, round the pass, at least one read back; never two buffers of one read.
    for k in range(count):
        lead = tier.lead_of(k)
        assert 1 <= lead <= count and tier.staging[(k - lead) % count] == tier.staging[k]
        assert all(tier.staging[(k - d) % count] != tier.staging[k] for d in range(1, lead))
    if count and count % read_ahead == 0:
        assert tier.lead == read_ahead
    assert DiskTierPlan.from_json(tier.to_json()) == tier


def _checkpoint(tmp_path: Path) -> tuple[Path, OffloadPlan, ModelSpec]:
    path = save(build("llama"), tmp_path, sharded=True)
    spec = read_checkpoint(path).spec
    return path, make_plan(spec, OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot()), spec


def test_a_checkpoints_parameters_are_read_where_they_lie(tmp_path: Path) -> None:
    path, plan, spec = _checkpoint(tmp_path)
    found = checkpoint_extents(path)
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes * 3 // 4, disk_gbps=1.5,
                          layer_names=[layer.name for layer in spec.layers], tensors=found.tensors,
                          extents=found.extents, files=found.files)
    assert tier.disk_positions and tier.spill_bytes == 0
    for p in tier.params:
        assert p.source is DiskSource.CHECKPOINT
        assert p.extent == found.extents[f"{spec.layers[p.layer].name}.{p.name}"]
    assert {f.path for f in tier.files} == {p.extent.path for p in tier.params if p.extent is not None}
    assert tier.read_seconds == pytest.approx(tier.disk_bytes / 1.5e9)


def test_a_parameter_whose_bytes_are_not_the_checkpoints_is_spilled_with_its_reason(tmp_path: Path) -> None:
    path, _, spec = _checkpoint(tmp_path)
    halved = ModelSpec(layers=tuple(attrs.evolve(layer, params=tuple(
        attrs.evolve(p, dtype="float16", itemsize=2) if p.name.endswith("up_proj.weight") else p
        for p in layer.params)) for layer in spec.layers))
    plan = make_plan(halved, OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot())
    found = checkpoint_extents(path)
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes // 2, disk_gbps=1.5, read_ahead=1, tensors=found.tensors,
                          layer_names=[layer.name for layer in spec.layers], extents=found.extents,
                          files=found.files)
    spilled = [p for p in tier.params if p.source is DiskSource.SPILL]
    assert spilled and all(p.name.endswith("up_proj.weight") for p in spilled)
    assert {p.reason for p in spilled} == {"dtype float32 in the checkpoint, float16 in the model"}
    assert tier.spill_bytes == sum(p.nbytes for p in spilled)
    assert f"spill:    {len(spilled)} parameters: dtype float32 in the checkpoint, float16 in the model" in \
        render_disk_tier(tier, device_bytes=0)


def test_the_rendering_names_the_three_tiers_and_the_budget() -> None:
    plan = make_plan(preset_spec("llama-8b"), OffloadConfig(group_size=2, prefetch_step=2), EnvSnapshot())
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes // 2, disk_gbps=2.0)
    text = render_disk_tier(tier, device_bytes=123)
    assert text.splitlines()[0] == (f"tiers:    device 123 B, host {format_bytes(tier.host_tier_bytes)}, "
                                    f"disk {format_bytes(tier.disk_bytes)}")
    assert f"{len(tier.disk_layers)} layers on disk" in text and "(budget " in text
    assert tier.host_bytes <= plan.host_bytes // 2
    enough = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes, disk_gbps=2.0)
    assert enough.disk_positions == () and "disk:     none" in render_disk_tier(enough, device_bytes=0)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"read_ahead": 0}, "read_ahead"), ({"disk_gbps": 0.0}, "disk_gbps"), ({"layer_names": ("a",)}, "layer_names"),
])
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, object], name: str) -> None:
    plan = make_plan(preset_spec("llama-8b"), OffloadConfig(group_size=2), EnvSnapshot())
    arguments: dict[str, object] = {"host_budget_bytes": 1 << 40, "disk_gbps": 1.0, **kwargs}
    with pytest.raises(PlanError) as caught:
        plan_disk_tier(plan, **arguments)  # type: ignore[arg-type]
    assert caught.value.name == name


def test_a_plan_of_another_backend_is_refused() -> None:
    plan = make_plan(preset_spec("llama-8b"), OffloadConfig(backend="uva", uva_max_bytes=1 << 30), EnvSnapshot())
    with pytest.raises(PlanError, match="streams through the prefetch backend's slots; this plan's backend is uva"):
        plan_disk_tier(plan, host_budget_bytes=1, disk_gbps=1.0)


def test_a_disk_param_holds_its_source_rules() -> None:
    extent = DiskExtent(path="f", offset=8, length=4)
    DiskParam(layer=0, name="w", nbytes=4, source=DiskSource.CHECKPOINT, extent=extent)
    bads: list[dict[str, Any]] = [
                {"source": DiskSource.CHECKPOINT},  # no extent
                {"source": DiskSource.SPILL, "extent": extent, "reason": "x"},
                {"source": DiskSource.SPILL},  # no reason
                {"source": DiskSource.CHECKPOINT, "extent": attrs.evolve(extent, length=5)}]
    for bad in bads:
        with pytest.raises(PlanError):
            DiskParam(layer=0, name="w", nbytes=4, **bad)


def test_json_that_breaks_a_rule_or_is_another_document_is_refused() -> None:
    plan = make_plan(preset_spec("llama-8b"), OffloadConfig(group_size=2, prefetch_step=2), EnvSnapshot())
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes // 2, disk_gbps=2.0)
    document = json.loads(tier.to_json())
    document["disk"]["disk_bytes"] += 1
    with pytest.raises(PlanError, match="disk bytes"):
        DiskTierPlan.from_json(json.dumps(document))
    twice = json.loads(tier.to_json())
    twice["disk"]["read_order"] = [twice["disk"]["read_order"][0]] * len(twice["disk"]["read_order"])
    with pytest.raises(PlanError, match="does not read each of the disk positions"):
        DiskTierPlan.from_json(json.dumps(twice))
    with pytest.raises(PlanError, match="not an offload-disk-tier/1 document"):
        DiskTierPlan.from_json(plan.to_json())


def test_extents_in_files_the_plan_does_not_identify_are_refused(tmp_path: Path) -> None:
    path, plan, spec = _checkpoint(tmp_path)
    found = checkpoint_extents(path)
    with pytest.raises(PlanError, match="which the plan does not identify"):
        plan_disk_tier(plan, host_budget_bytes=plan.host_bytes * 3 // 4, disk_gbps=1.5, tensors=found.tensors,
                       layer_names=[layer.name for layer in spec.layers], extents=found.extents)


def test_a_read_order_out_of_the_copies_order_is_refused() -> None:
    with pytest.raises(PlanError, match="is not the order the pass copies"):
        check_read_order((0, 1), (1, 0), (0, 1))
    with pytest.raises(PlanError, match="exactly once"):
        check_read_order((0,), (1, 0), (0, 1))
