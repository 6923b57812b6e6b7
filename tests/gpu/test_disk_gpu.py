"""The disk tier on a real CUDA device (Note [disk tier]): layers spilled to a file, read
by the reader's threads into pinned staging buffers and copied to the slots on the copy
stream. The reads of a buffer wait for the copy out of it on its event (`block_on`, from
the reader's threads), so the outputs equal the resident model's bit for bit, pass after
pass; every staging buffer is page-locked as the plan pins; a CUDA graph capture is
refused; an eager forward after a compiled one is exact.

Skipped without CUDA (see conftest.py). The lent machine has no transformers: the tier is
planned without a checkpoint, so every disk layer goes to the spill file.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan
from offload.executors import PrefetchOffloader
from offload.graphs import capture_forward
from offload.pure.disk.tier import DiskTierPlan, plan_disk_tier
from offload.runtime.cuda import CudaRuntime
from tests.executors.models import layer_list
from tests.gpu.test_prefetch_gpu import gpu_inputs, gpu_model, plan_for

NUM_LAYERS = 8


def _tier(plan: OffloadPlan, read_ahead: int) -> DiskTierPlan:
    """Half the offloaded bytes in host memory: the last layers on disk."""
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes // 2, disk_gbps=1.0, read_ahead=read_ahead)
    assert read_ahead < len(tier.disk_positions) < len(plan.offloaded_layers)
    return tier


def _offload(model: nn.Module, plan: OffloadPlan, tier: DiskTierPlan, spill: Path) -> PrefetchOffloader:
    off = PrefetchOffloader(plan, CudaRuntime(), disk=tier, spill_dir=spill)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off


@pytest.mark.parametrize("read_ahead", [1, 2, 3])
def test_disk_layers_stream_through_pinned_staging_bit_for_bit(tmp_path: Path, read_ahead: int) -> None:
    model = gpu_model(NUM_LAYERS)
    reference = copy.deepcopy(model)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=True)
    tier = _tier(plan, read_ahead)
    off = _offload(model, plan, tier, tmp_path)
    for x in gpu_inputs(seed=1, count=5):
        assert torch.equal(model(x), reference(x))
    stats = off.stats()
    assert stats.disk_layers == len(tier.disk_positions) and stats.disk_bytes_read >= tier.disk_bytes
    assert stats.pin_fallbacks == 0  # the staging buffers are page-locked as the plan pins
    assert stats.disk_misses == 0  # every copy found its read started ahead
    off.restore()
    for x in gpu_inputs(seed=2, count=1):
        assert torch.equal(model(x), reference(x))


def test_pageable_staging_when_the_plan_does_not_pin(tmp_path: Path) -> None:
    model = gpu_model(NUM_LAYERS)
    reference = copy.deepcopy(model)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=False)
    off = _offload(model, plan, _tier(plan, 2), tmp_path)
    for x in gpu_inputs(seed=3, count=3):
        assert torch.equal(model(x), reference(x))
    off.restore()


def test_a_cuda_graph_capture_is_refused(tmp_path: Path) -> None:
    model = gpu_model(NUM_LAYERS)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=True)
    off = _offload(model, plan, _tier(plan, 2), tmp_path)
    first = next(gpu_inputs(seed=4, count=1))
    with pytest.raises(ExecutionError, match="with a disk tier"):
        capture_forward(model, first, off)
    torch.cuda.synchronize()
    off.restore()


def test_an_eager_forward_after_a_compiled_one_is_exact(tmp_path: Path) -> None:
    model = gpu_model(NUM_LAYERS)
    reference = copy.deepcopy(model)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=True)
    off = _offload(model, plan, _tier(plan, 2), tmp_path)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            for x in gpu_inputs(seed=5, count=2):
                assert torch.equal(compiled(x), reference(x))
            for x in gpu_inputs(seed=6, count=2):
                assert torch.equal(model(x), reference(x))
    finally:
        off.restore()
        torch._dynamo.reset()
