"""`offload_model(..., host_budget_bytes=)`: a Llama-shaped and a MoE `transformers` model
with all three tiers in use (resident layers, offloaded layers in host memory, offloaded
layers on disk), their disk layers read from the checkpoint where they lie (one file and
sharded) or from a spill file: greedy ``generate`` logits bit for bit equal to the
resident model's, ``state_dict`` the real weights while offloaded, and ``restore`` giving
every weight back bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from offload import EnvSnapshot, OffloadConfig
from offload.hf import ModelOffloader, offload_model
from offload.pure.disk.tier import DiskSource, DiskTierPlan
from offload.runtime.cpu import CpuRuntime
from tests.executors.disk_helpers import CONFIGS, PLAN, build_model, plan_tier, read_per_pass, weights
from tests.hf.checkpoints import save, step_logits


def _offload(model: PreTrainedModel, tmp_path: Path, checkpoint: Path | None) -> ModelOffloader:
    """Offloaded with a host budget that puts three layers on disk, more than the ring's
    two buffers (a MoE layer's staging leaves its experts out, so one byte short of the
    host copies would put only one there, read once and kept)."""
    budget = plan_tier(model, checkpoint, disk_layers=3)[1].host_budget_bytes
    return offload_model(model, PLAN, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=budget,
                         checkpoint=checkpoint, spill_dir=tmp_path)


def _three_tiers(offloader: ModelOffloader) -> DiskTierPlan:
    tier = offloader.disk_tier
    assert tier is not None and tier.disk_positions, "no layer on disk"
    plan = offloader.plan
    assert any(not p.offloaded for p in plan.params), "no resident weight in the layers"
    assert tier.host_tier_bytes > 0, "no offloaded layer in host memory"
    assert len(tier.disk_positions) < len(plan.offloaded_layers)
    return tier


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("source", ["single", "sharded", "spill"])
def test_three_tiers_generate_bit_for_bit(arch: str, source: str, tmp_path: Path) -> None:
    model = build_model(arch)
    checkpoint = None if source == "spill" else save(model, tmp_path / "ckpt", sharded=source == "sharded")
    want = step_logits(model)
    before = weights(model)
    offloader = _offload(model, tmp_path, checkpoint)
    tier = _three_tiers(offloader)
    if source == "spill":
        assert tier.spill_bytes == tier.disk_bytes and all(p.source is DiskSource.SPILL for p in tier.params)
    else:
        spilled = [p for p in tier.params if p.source is DiskSource.SPILL]
        if arch == "mixtral":
            # transformers fuses the experts at load and saves them as they were: not in the
            # checkpoint as the model holds them, so spilled; the attention is read in place.
            assert spilled and all(".mlp." in f".{p.name}" and p.reason.startswith("no checkpoint tensor named")
                                   for p in spilled), [(p.name, p.reason) for p in spilled]
            assert any(p.name.startswith("self_attn.") and p.source is DiskSource.CHECKPOINT for p in tier.params)
        else:
            assert not spilled and tier.spill_bytes == 0
        assert tier.spill_bytes == sum(p.nbytes for p in spilled)
        paths = {p.extent.path for p in tier.params if p.extent is not None}
        assert len(paths) == 1 if source == "single" else len(paths) > 1
    got = step_logits(model)
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    stats = offloader.stats()
    assert stats.disk_layers == len(tier.disk_positions)
    # Every pass reads the disk layers that share a staging buffer.
    assert stats.disk_bytes_read >= stats.steps * read_per_pass(tier) > 0
    # While offloaded, state_dict gives the real weights (those on disk included).
    state = model.state_dict()
    for name, value in before.items():
        if name in state:
            assert torch.equal(state[name], value), name
    offloader.restore()
    after = weights(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    again = step_logits(model)
    for a, b in zip(want, again, strict=True):
        assert torch.equal(a, b)


def test_host_memory_holds_the_host_tier_and_the_ring_not_the_disk_layers(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    offloader = _offload(model, tmp_path, checkpoint)
    tier = _three_tiers(offloader)
    assert offloader.stats().host_bytes == tier.host_tier_bytes + tier.staging_ring_bytes
    offloader.restore()


def test_a_weight_changed_after_loading_is_spilled_not_read_from_the_checkpoint(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=True)
    last: Any = model.model.layers[-1]  # on disk: the last offloaded layer
    with torch.no_grad():
        last.mlp.up_proj.weight.add_(1.0)  # no longer the checkpoint's bytes
    want = step_logits(model)
    offloader = _offload(model, tmp_path, checkpoint)
    tier = _three_tiers(offloader)
    assert tier.disk_layers[-1] == len(model.model.layers) - 1
    got = step_logits(model)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    offloader.restore()


def test_an_encoder_and_a_decoder_on_disk_decode_exactly_with_the_reads_ahead(tmp_path: Path) -> None:
    """Whisper's encoder runs once per request and its decoder once per token (two schedule
    cycles). With layers of both on disk and one staging buffer, each cycle's reads wrap
    within the cycle: a token's decoder layers find their reads started ahead; only the
    switches between the stacks read on the spot."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    def build_whisper() -> Any:  # layers of about 1 MB: a staging buffer's alignment is small beside them
        config = WhisperConfig(vocab_size=96, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                               decoder_ffn_dim=512, d_model=128, max_source_positions=16, max_target_positions=32,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        torch.manual_seed(0)
        made: Any = WhisperForConditionalGeneration(config)
        return made.eval()

    model = build_whisper()
    reference = build_whisper()
    config = OffloadConfig(group_size=1, prefetch_step=1)
    plan = plan_tier(model, None, read_ahead=1, config=config)[0]
    budget = plan.host_bytes - 1
    while True:  # the budget that puts a layer of each stack on disk
        offloader = offload_model(model, config, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=budget,
                                  spill_dir=tmp_path, read_ahead=1)
        found = offloader.disk_tier
        assert found is not None
        if {plan.schedule.cycle_of[p] for p in found.disk_positions} == {0, 1}:
            break
        offloader.restore()
        budget -= 64 << 10
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    run: Any = model
    ref: Any = reference
    requests, tokens = 2, 5
    with torch.inference_mode():
        for _request in range(requests):
            encoded = run.model.encoder(features).last_hidden_state
            assert torch.equal(encoded, ref.model.encoder(features).last_hidden_state)
            ids = torch.ones(2, 1, dtype=torch.long)
            for _token in range(tokens):
                logits = run(encoder_outputs=(encoded,), decoder_input_ids=ids).logits
                assert torch.equal(logits, ref(encoder_outputs=(encoded,), decoder_input_ids=ids).logits)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    stats = offloader.stats()
    assert stats.realignments == 0
    assert stats.disk_misses <= 2 * requests, stats.disk_misses  # not one per token
    offloader.restore()


def test_quantised_weights_on_disk_are_spilled_by_their_inner_tensors_bit_for_bit(tmp_path: Path) -> None:
    """torchao int8 weights: their inner tensors (no checkpoint holds them as the model
    does) go to the spill file, and greedy ``generate`` stays bit for bit."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    made: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped
    model: Any = made.eval().to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    want = step_logits(model)
    plan = plan_tier(model, None, read_ahead=2)[0]
    offloader = offload_model(model, PLAN, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=plan.host_bytes - 1,
                              spill_dir=tmp_path)
    tier = _three_tiers(offloader)
    assert tier.spill_bytes == tier.disk_bytes and any(".parametrizations." in p.name for p in tier.params)
    for a, b in zip(want, step_logits(model), strict=True):
        assert torch.equal(a, b)
    offloader.restore()
    for a, b in zip(want, step_logits(model), strict=True):
        assert torch.equal(a, b)
