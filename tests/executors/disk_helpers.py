"""Small `transformers` models with enough layers for all three tiers, and their disk tier
planned as `offload_model(..., host_budget_bytes=)` plans it (a budget one byte short of
the plan's host copies), for the disk tier's tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig, PreTrainedModel

from offload import EnvSnapshot, OffloadConfig, OffloadPlan
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.prefetch.disk import DiskIO
from offload.hf import ModelOffloader, find_stacks
from offload.hf.disk import DiskRequest, plan_model_disk
from offload.hf.model import plan_model
from offload.model.describe import describe_stacks
from offload.protocols import Runtime
from offload.pure.disk.tier import READ_BLOCK, DiskTierPlan
from tests.hf.checkpoints import VOCAB

__all__ = ["PLAN", "build_model", "plan_tier", "read_per_pass", "wrap", "weights"]


def _llama() -> PretrainedConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64)


CONFIGS = {"llama": _llama, "mixtral": _mixtral}

#: One layer in six stays resident; the five others are offloaded.
PLAN = OffloadConfig(group_size=6, num_in_group=5, prefetch_step=1)


def build_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A random 6-layer model of `arch` (``llama`` or ``mixtral``), in eval mode."""
    torch.manual_seed(seed)
    made: Any = AutoModelForCausalLM.from_config(CONFIGS[arch]())  # type: ignore[no-untyped-call]  # untyped
    made.eval()
    model: PreTrainedModel = made
    return model


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name (ties under each name)."""
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def plan_tier(model: nn.Module, checkpoint: Path | None, *, read_ahead: int = 2, config: OffloadConfig = PLAN,
              disk_layers: int | None = None) -> tuple[OffloadPlan, DiskTierPlan, list[nn.Module]]:
    """`model`'s plan, its disk tier and its layers: for a host budget one byte short of
    the plan's host copies, or the budget that puts exactly `disk_layers` layers on disk
    (more than `read_ahead`: with fewer the ring saves nothing)."""
    stacks = find_stacks(model, None)
    layers = [layer for stack in stacks for layer in stack]
    plan = plan_model(describe_stacks(stacks), EnvSnapshot(), config=config, device_budget_bytes=None,
                      outside_bytes=0)
    tier = plan_model_disk(model, layers, plan, EnvSnapshot(), DiskRequest(
        host_budget_bytes=plan.host_bytes - 1, checkpoint=checkpoint, read_ahead=read_ahead))
    assert tier is not None
    budget = plan.host_bytes - 1
    while disk_layers is not None and len(tier.disk_positions) < disk_layers:  # a smaller budget, a block at a time
        budget -= READ_BLOCK
        found = plan_model_disk(model, layers, plan, EnvSnapshot(), DiskRequest(
            host_budget_bytes=budget, checkpoint=checkpoint, read_ahead=read_ahead))
        assert found is not None
        tier = found
    assert disk_layers is None or len(tier.disk_positions) == disk_layers
    return plan, tier, layers


def wrap(model: nn.Module, layers: Sequence[nn.Module], plan: OffloadPlan, tier: DiskTierPlan, runtime: Runtime,
         spill_dir: Path, io: DiskIO | None = None, *, start: bool = True) -> ModelOffloader:
    """`model` offloaded with `tier` (wrapped, and `post_init` run when `start`)."""
    offloader = ModelOffloader(model, layers, PrefetchOffloader(plan, runtime, disk=tier, spill_dir=spill_dir,
                                                                disk_io=io), runtime)
    offloader.wrap_modules(layers)
    if start:
        offloader.post_init()
    return offloader


def read_per_pass(tier: DiskTierPlan) -> int:
    """Bytes a pass reads: the disk layers that share their staging buffer (a layer alone
    in its buffer is read once and stays), but for what the expert caches read in place."""
    layer_at = dict(zip(tier.disk_positions, tier.disk_layers, strict=True))
    sharing = {layer_at[position] for k, position in enumerate(tier.read_order)
               if tier.staging.count(tier.staging[k]) > 1}
    return sum(p.nbytes for p in tier.params if p.layer in sharing and not p.in_place)
