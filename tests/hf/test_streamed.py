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

from offload import CheckpointError, ConfigError, EnvSnapshot, OffloadConfig
from offload.hf import load_on_host, offload_pretrained
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


def test_fused_experts_are_refused_naming_the_weight(tmp_path: Path) -> None:
    """transformers fuses Mixtral's experts at load and saves them unfused: not readable by
    name, so a host budget that puts them on disk is refused before anything is read."""
    model = build_model("mixtral")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    budget = plan_tier(model, checkpoint)[0].host_bytes - 1
    with pytest.raises(CheckpointError, match=r"parameter 'mlp\.(gate|experts)[^']*' would go to disk") as caught:
        offload_pretrained(checkpoint, OffloadConfig(group_size=6, num_in_group=5, prefetch_step=1),
                           env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=budget)
    assert isinstance(caught.value.name, str) and caught.value.name.startswith("mlp.")


def test_from_pretrained_options_and_disk_options_alone_are_refused(tmp_path: Path) -> None:
    checkpoint = save(build("llama"), tmp_path / "ckpt", sharded=False)
    with pytest.raises(ConfigError, match="attn_implementation") as caught:
        offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=1 << 30,
                           attn_implementation="eager")
    assert caught.value.name == "attn_implementation"
    with pytest.raises(ConfigError, match="spill_dir is a disk tier option") as refused:
        offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(), spill_dir=tmp_path)
    assert refused.value.name == "spill_dir"
