"""`offload_pretrained(path, ..., host_budget_bytes=)`: the model built with its parameters
on meta and its weights read from the checkpoint by name, the disk layers mapped where
they lie (never read into host memory at load): greedy ``generate`` bit for bit equal to
the model `from_pretrained` loads, for Llama, Qwen3, Gemma (tied head) and GPT-2, from one
file and from shards; `restore` gives every weight back; what it cannot read by name is
refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload import ConfigError, EnvSnapshot, ExecutionError, OffloadConfig
from offload.hf import load_on_host, offload_pretrained
from offload.pure.disk.tier import DiskSource
from offload.runtime.cpu import CpuRuntime
from tests.executors.disk_helpers import build_model, plan_tier, weights
from tests.hf.checkpoints import build, save, step_logits

#: Three of four layers offloaded, one staging buffer: two layers go to disk.
FOUR = OffloadConfig(group_size=4, num_in_group=3)


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "gpt2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_streamed_load_generates_bit_for_bit(arch: str, sharded: bool, tmp_path: Path) -> None:
    checkpoint = save(build(arch), tmp_path / "ckpt", sharded=sharded)
    reference = load_on_host(checkpoint)
    want = step_logits(reference)
    budget = plan_tier(reference, checkpoint, read_ahead=1, config=FOUR)[0].host_bytes - 1
    model, offloader = offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, read_ahead=1)
    assert type(model) is type(reference)
    tier = offloader.disk_tier
    assert tier is not None and len(tier.disk_positions) == 2 and tier.spill_bytes == 0
    assert _equal(step_logits(model), want)
    # The disk layers were never loaded: their copies are the checkpoint's bytes, mapped.
    assert offloader.stats().host_bytes == tier.host_tier_bytes + tier.staging_ring_bytes
    offloader.restore()
    expected = weights(reference)
    got = weights(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], value) for name, value in expected.items())
    assert _equal(step_logits(model), want)


def test_fused_experts_load_from_the_weights_stored_one_per_expert(tmp_path: Path) -> None:
    """transformers fuses Mixtral's experts at load and saves them unfused: each disk-tier
    weight they make is written to the spill file from the stored tensors, and the model
    generates bit for bit; without spill_dir that is refused, naming the weight."""
    reference = build_model("mixtral")
    checkpoint = save(reference, tmp_path / "ckpt", sharded=False)
    config = OffloadConfig(group_size=6, num_in_group=5, prefetch_step=1)
    budget = plan_tier(reference, checkpoint, config=config)[0].host_bytes - 1
    with pytest.raises(ExecutionError, match=r"parameter 'mlp\.(gate|experts)[^']*'.*no spill_dir") as caught:
        offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=budget)
    assert caught.value.name == "spill_dir"
    model, offloader = offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, spill_dir=tmp_path)
    tier = offloader.disk_tier
    assert tier is not None and tier.spill_bytes > 0
    assert {p.name for p in tier.params if p.source is DiskSource.SPILL} == {
        "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert _equal(step_logits(model), step_logits(reference))


def test_from_pretrained_options_and_disk_options_alone_are_refused(tmp_path: Path) -> None:
    checkpoint = save(build("llama"), tmp_path / "ckpt", sharded=False)
    with pytest.raises(ConfigError, match="attn_implementation") as caught:
        offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=1 << 30,
                           attn_implementation="eager")
    assert caught.value.name == "attn_implementation"
    with pytest.raises(ConfigError, match="spill_dir is a disk tier option") as refused:
        offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(), spill_dir=tmp_path)
    assert refused.value.name == "spill_dir"
