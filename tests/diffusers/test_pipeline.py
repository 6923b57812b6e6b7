"""`offload_pipeline`: a tiny FluxPipeline built from configs (no hub): its text encoders',
transformer's and VAE's stacks offloaded by one offloader against one budget give the
image the resident pipeline gives, bit for bit; `restore` gives every tensor back."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from offload import ConfigError, OffloadConfig, Placement, PlanError
from offload.diffusers import offload_pipeline
from offload.hf import find_stacks
from offload.pure.fit.profiles import profile_by_name

VOCAB = 96


def _pipeline() -> Any:
    torch.manual_seed(0)
    transformer: Any = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                         pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))  # type: ignore[no-untyped-call]
    vae: Any = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 8),
                        layers_per_block=1, latent_channels=1, norm_num_groups=4, sample_size=16,
                        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0,
                        scaling_factor=1.0)  # type: ignore[no-untyped-call]
    clip: Any = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, max_position_embeddings=16, bos_token_id=0,
                                             eos_token_id=1, pad_token_id=2))
    t5: Any = T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2))
    scheduler: Any = FlowMatchEulerDiscreteScheduler()  # type: ignore[no-untyped-call]
    pipe: Any = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip.eval(),  # type: ignore[no-untyped-call]
                             tokenizer=None, text_encoder_2=t5.eval(), tokenizer_2=None, transformer=transformer.eval())
    vae.eval()
    return pipe


def _image(pipe: Any) -> torch.Tensor:
    """Encode a prompt (token ids: the pipeline has no tokenizer here) with its own text
    encoders, then denoise and decode."""
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        pooled = pipe.text_encoder(ids).pooler_output
        embeds = pipe.text_encoder_2(ids).last_hidden_state
        image: torch.Tensor = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=16, width=16,
                                   num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                                   output_type="pt").images
    return image


def _weights(pipe: Any) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name in ("text_encoder", "text_encoder_2", "transformer", "vae")
            for key, value in getattr(pipe, name).state_dict().items()}


def test_every_components_stacks_run_offloaded_and_the_image_is_the_resident_one() -> None:
    pipe = _pipeline()
    reference = copy.deepcopy(pipe)
    want = _image(reference)
    off = offload_pipeline(pipe, OffloadConfig(group_size=1, prefetch_step=1))
    stacks = [s for name in ("vae", "text_encoder", "text_encoder_2", "transformer")
              for s in find_stacks(getattr(pipe, name))]
    assert off.plan.num_layers == sum(len(s) for s in stacks)
    assert off.plan.schedule.cycles == tuple(len(s) for s in stacks)
    assert {p.placement for p in off.plan.offloaded_params} == {Placement.PREFETCH}
    assert torch.equal(_image(pipe), want)
    assert torch.equal(_image(pipe), want)  # again: every stack's cycle ran, none realigned
    assert off.stats().realignments == 0
    off.restore()
    before, after = _weights(reference), _weights(pipe)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_a_budget_a_quarter_of_the_pipeline_fits_across_its_components() -> None:
    pipe = _pipeline()
    reference = copy.deepcopy(pipe)
    total = sum(t.numel() * t.element_size() for t in _weights(pipe).values())
    off = offload_pipeline(pipe, device_budget_bytes=total // 4, profile=profile_by_name("h200-pcie5"))
    layers = off.plan.num_layers
    assert layers and off.plan.offloaded_params
    assert torch.equal(_image(pipe), _image(reference))
    off.restore()


def test_components_name_what_is_offloaded_and_bad_input_is_refused() -> None:
    pipe = _pipeline()
    off = offload_pipeline(pipe, OffloadConfig(group_size=1, prefetch_step=1), components=("transformer",))
    assert off.plan.num_layers == sum(len(s) for s in find_stacks(pipe.transformer))
    assert [name for name, _ in off.model.named_children()] == ["transformer"]  # the VAE is left as it is
    assert all("forward" not in module.__dict__ for module in pipe.vae.modules())
    off.restore()
    with pytest.raises(ConfigError, match="no module component 'unet'"):
        offload_pipeline(pipe, OffloadConfig(group_size=1), components=("unet",))
    with pytest.raises(ConfigError, match="takes a diffusers pipeline"):
        offload_pipeline(object(), OffloadConfig(group_size=1))
    with pytest.raises(PlanError, match="no component of the pipeline has a layer stack"):
        offload_pipeline(pipe, OffloadConfig(group_size=1), components=())
