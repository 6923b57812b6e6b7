"""Models of several layer stacks, every stack offloaded by one offloader against one
budget: Whisper (encoder, decoder), Llava (vision tower, language model) and Flux (double
and single blocks), tiny and random. Outputs are the resident model's bit for bit, each
stack prefetches on its own cycle (a decoder run per token never realigns), a device a
quarter of the model's size fits, and `offload plan DIR` covers the same layers as the
loaded model, in the order they run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadPlan, Placement, PlanError
from offload.cli import main
from offload.hf import find_stacks, offload_model, offload_pretrained
from offload.pure.fit.profiles import profile_by_name
from tests.hf.checkpoints import VOCAB, build_llava, build_whisper

PREFETCH = OffloadConfig(group_size=1, prefetch_step=1)
BACKENDS = {"prefetch": PREFETCH, "on-demand": OffloadConfig(backend="uva", uva_max_bytes=1 << 40)}


def build_flux() -> Any:
    """A random diffusers FluxTransformer2DModel with 2 double and 3 single blocks."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    made: Any = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                       pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))  # type: ignore[no-untyped-call]
    made.eval()
    return made


def build_deep_llava() -> Any:
    """A Llava whose layers outweigh its embeddings and head (as a real one's do): a
    4-layer vision tower and a 6-layer language model."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=256, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
    torch.manual_seed(0)
    made: Any = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                          image_token_index=VOCAB - 1))
    made.eval()
    return made


def _paths(model: nn.Module) -> list[tuple[str, int]]:
    stacks = find_stacks(model)
    return [(name, len(module)) for name, module in model.named_modules() if any(module is s for s in stacks)]


def _cycles_are_the_stacks(model: nn.Module, plan: OffloadPlan) -> None:
    sizes = [len(stack) for stack in find_stacks(model)]
    assert len(sizes) >= 2
    assert plan.num_layers == sum(sizes)
    if plan.schedule.num_positions:
        assert plan.schedule.cycles == tuple(sizes)  # every layer offloaded (group size 1): a cycle per stack
    else:  # on demand: every layer of every stack copies its weights per call
        assert {p.layer for p in plan.offloaded_params} == set(range(sum(sizes)))


def _assert_same_generation(model: Any, reference: Any, steps: int, **inputs: Any) -> None:
    """Greedy `generate` of `steps` tokens on both: the same tokens, and every step's logits
    bit for bit."""
    def generate(m: Any) -> Any:
        with torch.inference_mode():
            return m.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)

    got, want = generate(model), generate(reference)
    assert torch.equal(got.sequences, want.sequences) and len(got.scores) == steps
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))


def test_find_stacks_finds_every_stack_in_the_order_they_run() -> None:
    assert _paths(build_whisper()) == [("model.encoder.layers", 2), ("model.decoder.layers", 2)]
    assert _paths(build_llava()) == [("model.vision_tower.encoder.layers", 2), ("model.language_model.layers", 2)]
    assert _paths(build_flux()) == [("transformer_blocks", 2), ("single_transformer_blocks", 3)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_whisper_decodes_many_tokens_per_encoder_run_exactly_and_without_realigning(backend: str) -> None:
    model = build_whisper()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    _cycles_are_the_stacks(model, off.plan)
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    run: Any = model
    ref: Any = reference
    with torch.inference_mode():
        for _request in range(2):
            encoded = run.model.encoder(features).last_hidden_state
            assert torch.equal(encoded, ref.model.encoder(features).last_hidden_state)
            ids = torch.ones(2, 1, dtype=torch.long)
            for _token in range(5):
                logits = run(encoder_outputs=(encoded,), decoder_input_ids=ids).logits
                assert torch.equal(logits, ref(encoder_outputs=(encoded,), decoder_input_ids=ids).logits)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    assert off.stats().realignments == 0
    off.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_llava_generates_exactly_with_both_stacks_offloaded(backend: str) -> None:
    model = build_llava()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    _cycles_are_the_stacks(model, off.plan)
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randn(1, 3, 8, 8, generator=generator)
    image_tokens = 4  # (8 / 4) ** 2 patches, the class token dropped
    ids = torch.cat([torch.full((1, image_tokens), VOCAB - 1), torch.randint(2, VOCAB - 1, (1, 3), generator=generator)],
                    dim=1)

    _assert_same_generation(model, reference, 4, input_ids=ids, attention_mask=torch.ones_like(ids),
                            pixel_values=pixels, pad_token_id=0)
    # The vision tower runs once per request, the language model once per token: no realignment.
    assert off.stats().realignments == 0
    off.restore()


def _flux_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 4, generator=g), "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "pooled_projections": torch.randn(1, 8, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3)}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_flux_double_and_single_blocks_in_one_offloader(backend: str) -> None:
    model = build_flux()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    _cycles_are_the_stacks(model, off.plan)
    with torch.inference_mode():
        for _step in range(3):  # denoising steps
            assert torch.equal(model(**_flux_inputs()).sample, reference(**_flux_inputs()).sample)
    assert off.stats().realignments == 0
    off.restore()


def _nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("build", [build_whisper, build_deep_llava, build_flux], ids=["whisper", "llava", "flux"])
def test_a_device_a_quarter_of_the_model_fits_with_both_stacks(build: Any) -> None:
    model = build()
    reference = copy.deepcopy(model)
    budget = _nbytes(model) // 4
    off = offload_model(model, device_budget_bytes=budget, profile=profile_by_name("h200-pcie5"))
    plan = off.plan
    layers = [layer for stack in find_stacks(model) for layer in stack]
    sizes = [len(stack) for stack in find_stacks(model)]
    offloaded = {p.layer for p in plan.offloaded_params}
    bounds = [0, *[sum(sizes[:i + 1]) for i in range(len(sizes))]]
    for first, stop in zip(bounds, bounds[1:], strict=False):
        assert offloaded & set(range(first, stop)), "a stack stayed on the device"
    assert len(layers) == plan.num_layers
    assert {p.placement for p in plan.offloaded_params} <= {Placement.PREFETCH, Placement.ON_DEMAND, Placement.UVA}
    off.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))


def test_a_budget_that_fits_nothing_names_the_stacks() -> None:
    model = build_whisper()
    with pytest.raises(PlanError, match=r"model\.encoder\.layers 2 layers .*; model\.decoder\.layers 2 layers"):
        offload_model(model, device_budget_bytes=1, profile=profile_by_name("h200-pcie5"))


@pytest.mark.parametrize("build", [build_whisper, build_llava, build_flux], ids=["whisper", "llava", "flux"])
def test_offload_plan_of_the_checkpoint_covers_the_loaded_models_layers_in_order(
        build: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = build()
    saver: Any = saved
    saver.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--group-size", "1", "--json"]) == 0
    plan = OffloadPlan.from_json(capsys.readouterr().out)
    model, off = offload_pretrained(tmp_path, PREFETCH)
    assert off.plan.num_layers == plan.num_layers
    assert plan.schedule.cycles == off.plan.schedule.cycles == tuple(len(s) for s in find_stacks(model))
    # The same parameters per layer, layer by layer (as the checkpoint and the model name them).
    for layer in range(plan.num_layers):
        from_headers = sorted(p.nbytes for p in plan.params if p.layer == layer)
        loaded = sorted(p.nbytes for p in off.plan.params if p.layer == layer)
        assert from_headers == loaded, layer
    off.restore()
    assert json.loads(plan.to_json())["plan"]["schedule"]["cycles"] == list(plan.schedule.cycles)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_t5_generates_exactly_with_its_encoder_and_decoder_offloaded(backend: str) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    extra: dict[str, Any] = {"decoder_start_token_id": 0}  # read by generate; absent from the typed signature
    made: Any = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_layers=3,
                                                    num_decoder_layers=3, num_heads=2, pad_token_id=0,
                                                    eos_token_id=1, **extra))
    model: Any = made.eval()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    _cycles_are_the_stacks(model, off.plan)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))

    _assert_same_generation(model, reference, 5, input_ids=ids)
    assert off.stats().realignments == 0
    off.restore()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_whisper_generate_is_exact_at_every_step(backend: str) -> None:
    model = build_whisper()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    features = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))

    _assert_same_generation(model, reference, 4, input_features=features)
    assert off.stats().realignments == 0
    off.restore()


def test_offload_plan_fit_that_fits_nothing_names_the_stacks(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    saver: Any = build_whisper()
    saver.save_pretrained(tmp_path)
    code = main(["plan", str(tmp_path), "--fit-gib", "0.000001", "--link-gbps", "25", "--tflops", "150"])
    err = capsys.readouterr().err
    assert code == 2
    assert "(the model's stacks, all planned: model.encoder.layers: 2 layers (plan layers 0-1)" in err
    assert "; model.decoder.layers: 2 layers (plan layers 2-3)" in err
