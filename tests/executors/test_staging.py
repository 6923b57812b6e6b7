"""The disk tier's staging ring (`offload.executors.staging`) over a real checkpoint and a
spill file: a pass of reads in the tier's order fills each disk position's buffer with its
parameters bit for bit; a buffer is refilled only after what the caller says it waits for;
a position already held is not read again; a failed read names the file and the next
stage reads again."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offload import EnvSnapshot, ExecutionError, OffloadConfig, make_plan
from offload.executors.staging import StagingRing
from offload.model.checkpoint import checkpoint_extents, checkpoint_files, read_checkpoint
from offload.pure.disk.tier import DiskSource, DiskTierPlan, plan_disk_tier
from offload.pure.spec.values import ParamSpec
from offload.runtime.diskio import DiskReader, Source
from offload.runtime.spill import SpillFile
from tests.hf.checkpoints import build, save


def _setup(tmp_path: Path, read_ahead: int = 2) -> tuple[DiskTierPlan, dict[str, torch.Tensor], list[str], Path]:
    path = save(build("llama"), tmp_path / "ckpt", sharded=True)
    spec = read_checkpoint(path).spec
    plan = make_plan(spec, OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot())
    found = checkpoint_extents(path)
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes * 3 // 4, disk_gbps=1.0, read_ahead=read_ahead,
                          layer_names=[layer.name for layer in spec.layers], tensors=found.tensors,
                          extents=found.extents, files=found.files)
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        loaded.update(load_file(os.fspath(file)))
    return tier, loaded, [layer.name for layer in spec.layers], path


def _specs(path: Path) -> dict[tuple[int, str], ParamSpec]:
    return {(layer.index, param.name): param for layer in read_checkpoint(path).spec.layers for param in layer.params}


def _ring(tier: DiskTierPlan, reader: DiskReader, path: Path) -> StagingRing:
    """A ring reading each disk parameter from the checkpoint where it lies."""
    sources: dict[tuple[int, str], tuple[Source, int]] = {}
    for p in tier.params:
        assert p.extent is not None
        sources[(p.layer, p.name)] = (p.extent.path, p.extent.offset)
    # Each from a 4096-byte block on, as the executor allocates them (congruent reads go straight in).
    allocations = [torch.empty(tier.staging_bytes + 4096, dtype=torch.uint8) for _ in range(tier.buffers)]
    buffers = [a[(-a.data_ptr()) % 4096:][:tier.staging_bytes] for a in allocations]
    return StagingRing(tier, reader, buffers, sources, _specs(path))


def _waiter(waited: list[int], k: int) -> Callable[[], None]:
    return lambda: waited.append(k)


def test_a_pass_of_reads_fills_every_position_with_its_parameters(tmp_path: Path) -> None:
    tier, loaded, names, path = _setup(tmp_path)
    assert len(tier.disk_positions) >= 2 and tier.buffers == 2
    waited: list[int] = []
    with DiskReader(threads=2) as reader:
        ring = _ring(tier, reader, path)
        for _ in range(2):  # two passes: every buffer refilled
            for k, position in enumerate(tier.read_order):
                ring.stage(position, after=_waiter(waited, k))
                ring.ready(position)
                layer = tier.disk_layers[tier.disk_positions.index(position)]
                for (_, name), view in ring.views(position).items():
                    assert torch.equal(view, loaded[f"{names[layer]}.{name}"]), name
    assert set(waited) == set(range(len(tier.read_order)))


def test_a_position_its_buffer_holds_is_not_read_again(tmp_path: Path) -> None:
    tier, _, _, path = _setup(tmp_path)
    with DiskReader(threads=1) as reader:
        ring = _ring(tier, reader, path)
        first = tier.read_order[0]
        ring.stage(first)
        ring.ready(first)
        requests = reader.stats().requests
        ring.stage(first)
        ring.ready(first)
        assert reader.stats().requests == requests and ring.holds(first)


def test_a_failed_read_names_the_file_and_the_next_stage_reads_again(tmp_path: Path) -> None:
    tier, loaded, names, path = _setup(tmp_path)
    position = tier.read_order[0]
    victim = next(p for p in tier.params if p.layer == tier.disk_layers[tier.disk_positions.index(position)])
    assert victim.extent is not None
    whole = Path(victim.extent.path).read_bytes()
    with DiskReader(threads=1) as reader:
        ring = _ring(tier, reader, path)
        os.truncate(victim.extent.path, victim.extent.offset)  # the file ends before the tensor
        with pytest.raises(ExecutionError, match="short read of") as caught:
            ring.stage(position)
            ring.ready(position)
        assert caught.value.name == victim.extent.path and not ring.holds(position)
        Path(victim.extent.path).write_bytes(whole)
        ring.ready(position)
        layer = victim.layer
        assert torch.equal(ring.views(position)[(layer, victim.name)], loaded[f"{names[layer]}.{victim.name}"])


def test_a_spilled_parameter_is_read_from_the_spill_file(tmp_path: Path) -> None:
    tier, loaded, names, _ = _setup(tmp_path)
    with SpillFile(tmp_path) as spill, DiskReader(threads=2) as reader:
        sources: dict[tuple[int, str], tuple[Source, int]] = {}
        for p in tier.params:
            offset, _ = spill.append(loaded[f"{names[p.layer]}.{p.name}"])
            sources[(p.layer, p.name)] = (spill.read_fd, offset)
        spill.flush()
        specs = _specs(tmp_path / "ckpt")
        buffers = [torch.empty(tier.staging_bytes, dtype=torch.uint8) for _ in range(tier.buffers)]
        ring = StagingRing(tier, reader, buffers, sources, specs)
        for position in tier.read_order:
            ring.ready(position)
            layer = tier.disk_layers[tier.disk_positions.index(position)]
            for (_, name), view in ring.views(position).items():
                assert torch.equal(view, loaded[f"{names[layer]}.{name}"])
    assert {p.source for p in tier.params} == {DiskSource.CHECKPOINT}  # the premise: read elsewhere on purpose


def test_buffers_that_are_not_the_tiers_are_refused(tmp_path: Path) -> None:
    tier, _, _, _ = _setup(tmp_path)
    with DiskReader(threads=1) as reader, pytest.raises(ExecutionError, match="the staging ring takes 2 contiguous"):
        StagingRing(tier, reader, [torch.empty(tier.staging_bytes - 1, dtype=torch.uint8)] * 2, {}, {})


def test_a_layer_that_lies_in_one_run_of_its_file_is_one_read(tmp_path: Path) -> None:
    """A layer's tensors lie one after another in a file: laid out the same way in the
    buffer (congruent), they are read as one request per layer."""
    path = save(build("llama"), tmp_path / "ckpt", sharded=False)
    spec = read_checkpoint(path).spec
    plan = make_plan(spec, OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot())
    found = checkpoint_extents(path)
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes - 1, disk_gbps=1.0, read_ahead=2,
                          layer_names=[layer.name for layer in spec.layers], tensors=found.tensors,
                          extents=found.extents, files=found.files)
    loaded = load_file(os.fspath(path / "model.safetensors"))
    names = [layer.name for layer in spec.layers]
    with DiskReader(threads=2) as reader:
        ring = _ring(tier, reader, path)
        for position in tier.read_order:
            ring.ready(position)
            layer = tier.disk_layers[tier.disk_positions.index(position)]
            for (_, name), view in ring.views(position).items():
                assert torch.equal(view, loaded[f"{names[layer]}.{name}"]), name
        assert reader.stats().requests == len(tier.read_order)
        # Only each run's partial first and last blocks went through staging.
        assert reader.stats().staged_bytes <= 2 * 4096 * len(tier.read_order) < tier.disk_bytes
