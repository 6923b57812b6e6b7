"""A device budget and a host budget together (`offload_model(..., device_budget_bytes=,
host_budget_bytes=)`): the fit chooses within both, with a disk tier where the host budget
needs one, and the model runs bit for bit; budgets no plan meets are refused naming the
least that work; a host budget alone on a machine without an accelerator offloads every
layer and puts on disk what it does not hold."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from offload.errors import PlanError
from offload.hf import offload_model
from offload.hf.layers import find_stacks
from offload.hf.model import CPU_TIER_CONFIG, plan_model
from offload.hf.offloader import outside_bytes, outside_tensors
from offload.model.describe import describe_stacks
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.plan.plan import Backend
from offload.runtime.cpu import CpuRuntime
from tests.hf.checkpoints import VOCAB, step_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def build(seed: int = 0) -> PreTrainedModel:
    """A llama of 8 layers of 148 KiB, so that a disk tier's staging ring is small beside
    the layers it spares host memory for."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    made: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    made.eval()
    model: PreTrainedModel = made
    return model


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _sizes() -> tuple[int, int]:
    """(bytes of the llama's layers, bytes outside them)."""
    model = build()
    stacks = find_stacks(model)
    return describe_stacks(stacks).nbytes, outside_bytes(outside_tensors(model, [l for s in stacks for l in s]))


def test_a_device_budget_that_fit_meets_with_uva_and_a_small_host_budget_run_with_a_disk_tier(tmp_path: Path) -> None:
    layers, outside = _sizes()
    device = int((layers + outside) * 0.6)
    model = build()
    expected = step_logits(model)
    stacks = find_stacks(model)
    spec = describe_stacks(stacks)
    # Without a host budget the fit picks UVA here (the case that was refused with one).
    alone = plan_model(spec, EnvSnapshot(), config=None, device_budget_bytes=device, outside_bytes=outside)
    assert alone.backend is Backend.UVA
    host = alone.host_bytes - 1  # a byte less than UVA's host copies: UVA cannot meet it
    offloader = offload_model(model, device_budget_bytes=device, host_budget_bytes=host, spill_dir=tmp_path,
                              env=EnvSnapshot(), runtime=CpuRuntime())
    tier = offloader.disk_tier
    assert offloader.plan.backend is Backend.PREFETCH
    assert tier is not None and tier.disk_positions
    assert tier.host_bytes <= host
    assert _same(step_logits(model), expected)
    assert offloader.stats().disk_bytes_read > 0
    offloader.restore()
    assert _same(step_logits(model), expected)


def test_a_host_budget_uva_meets_keeps_uva_and_no_tier(tmp_path: Path) -> None:
    layers, outside = _sizes()
    device = int((layers + outside) * 0.6)
    model = build()
    expected = step_logits(model)
    spec = describe_stacks(find_stacks(model))
    alone = plan_model(spec, EnvSnapshot(), config=None, device_budget_bytes=device, outside_bytes=outside)
    offloader = offload_model(model, device_budget_bytes=device, host_budget_bytes=alone.host_bytes,
                              spill_dir=tmp_path, env=EnvSnapshot(), runtime=CpuRuntime())
    assert offloader.plan == alone
    assert offloader.disk_tier is None
    assert _same(step_logits(model), expected)
    offloader.restore()


def test_budgets_no_plan_meets_are_refused_naming_the_least_that_work(tmp_path: Path) -> None:
    layers, outside = _sizes()
    device = int((layers + outside) * 0.6)
    model = build()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(PlanError) as caught:
        offload_model(model, device_budget_bytes=device, host_budget_bytes=1, spill_dir=tmp_path,
                      env=EnvSnapshot(), runtime=CpuRuntime())
    assert caught.value.name == "host_budget_bytes"
    message = caught.value.message
    found = re.search(r"least host budget is [^(]*\((\d+) bytes.*least device budget is [^(]*\((\d+) bytes", message)
    assert found is not None, message
    least_host, least_device = int(found.group(1)), int(found.group(2))
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    # Each named budget works with the other as given.
    offloader = offload_model(model, device_budget_bytes=device, host_budget_bytes=least_host, spill_dir=tmp_path,
                              env=EnvSnapshot(), runtime=CpuRuntime())
    offloader.restore()
    offloader = offload_model(model, device_budget_bytes=least_device, host_budget_bytes=1, spill_dir=tmp_path,
                              env=EnvSnapshot(), runtime=CpuRuntime())
    offloader.restore()
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def test_a_host_budget_alone_without_an_accelerator_offloads_every_layer_and_spills_the_rest(tmp_path: Path) -> None:
    model = build()
    expected = step_logits(model)
    layers, _ = _sizes()
    offloader = offload_model(model, host_budget_bytes=layers // 2, spill_dir=tmp_path, env=EnvSnapshot(),
                              runtime=CpuRuntime())
    plan = offloader.plan
    assert (plan.backend, plan.schedule.num_positions) == (Backend.PREFETCH, len(model.model.layers))
    assert (plan.config.group_size, plan.config.num_in_group, plan.config.prefetch_step) == (
        CPU_TIER_CONFIG.group_size, CPU_TIER_CONFIG.num_in_group, CPU_TIER_CONFIG.prefetch_step)
    tier = offloader.disk_tier
    assert tier is not None and tier.host_bytes <= layers // 2
    assert _same(step_logits(model), expected)
    offloader.restore()


def test_offload_pretrained_streams_with_both_budgets_and_with_a_host_budget_alone(tmp_path: Path) -> None:
    from offload.hf import offload_pretrained
    from tests.hf.checkpoints import save

    resident = build()
    expected = step_logits(resident)
    directory = save(resident, tmp_path / "ckpt", sharded=True)
    layers, outside = _sizes()
    device = int((layers + outside) * 0.6)
    spec = describe_stacks(find_stacks(resident))
    alone = plan_model(spec, EnvSnapshot(), config=None, device_budget_bytes=device, outside_bytes=outside)
    assert alone.backend is Backend.UVA
    for options in ({"device_budget_bytes": device, "host_budget_bytes": alone.host_bytes - 1},
                    {"host_budget_bytes": layers // 2}):  # the second: no config, no device budget, no GPU
        model, offloader = offload_pretrained(directory, env=EnvSnapshot(), runtime=CpuRuntime(),
                                              spill_dir=tmp_path, **options)  # type: ignore[arg-type]
        tier = offloader.disk_tier
        assert offloader.plan.backend is Backend.PREFETCH and tier is not None
        assert tier.host_bytes <= options["host_budget_bytes"]
        assert _same(step_logits(model), expected), options
        offloader.restore()
