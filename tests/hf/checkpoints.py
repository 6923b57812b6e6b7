"""Small random `transformers` models built from configs (nothing is downloaded), and
checkpoints of them written with ``save_pretrained``, for the Hugging Face tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
)

__all__ = ["ARCHITECTURES", "VOCAB", "build", "save", "step_logits"]

VOCAB = 96


def _llama() -> PretrainedConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _qwen3() -> PretrainedConfig:
    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _gpt2() -> PretrainedConfig:
    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                      bos_token_id=0, eos_token_id=1)


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)


def _gemma() -> PretrainedConfig:
    # Gemma ties the output head to the embedding.
    return GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


#: Architecture name -> its small config.
ARCHITECTURES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "gemma": _gemma,
}


def build(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A random model of `arch` in eval mode; weights drawn from `seed`."""
    torch.manual_seed(seed)
    # transformers leaves from_config and eval unannotated: go through Any.
    made: Any = AutoModelForCausalLM.from_config(ARCHITECTURES[arch](), dtype=dtype)  # type: ignore[no-untyped-call]
    made.eval()
    model: PreTrainedModel = made
    return model


def step_logits(model: PreTrainedModel, steps: int = 4) -> tuple[torch.Tensor, ...]:
    """The logits of every step of a greedy ``generate`` of `steps` tokens after two fixed
    prompts of 6 tokens (ids below `VOCAB`)."""
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    run: Any = model  # generate is not typed for mypy
    with torch.inference_mode():
        out = run.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=False, pad_token_id=0, output_scores=True,
                           return_dict_in_generate=True)
    scores: tuple[torch.Tensor, ...] = out.scores
    return scores


def save(model: PreTrainedModel, directory: Path, *, sharded: bool) -> Path:
    """Write `model` with ``save_pretrained``: one safetensors file, or many small shards
    with an index."""
    saver: Any = model  # save_pretrained's decorator hides its signature from mypy
    saver.save_pretrained(directory, max_shard_size="24KB" if sharded else "10GB")
    return directory


# ---- models that are not causal LMs (built by class, not by AutoModelForCausalLM) ----------


def build_whisper(*, seed: int = 0) -> PreTrainedModel:
    """A random WhisperForConditionalGeneration (an encoder and a decoder of 2 layers each;
    its ``proj_out`` is tied to the decoder's embedding), in eval mode."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, d_model=16, max_source_positions=16, max_target_positions=32,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(seed)
    made: Any = WhisperForConditionalGeneration(config)
    made.eval()
    model: PreTrainedModel = made
    return model


def build_llava(*, seed: int = 0) -> PreTrainedModel:
    """A random LlavaForConditionalGeneration (a 2-layer CLIP vision tower, a 2-layer Llama
    with its ``lm_head``), in eval mode."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
    torch.manual_seed(seed)
    made: Any = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                          image_token_index=VOCAB - 1))
    made.eval()
    model: PreTrainedModel = made
    return model


def build_flux(*, seed: int = 0) -> Any:
    """A random diffusers FluxTransformer2DModel (one double and one single block, about
    20 thousand parameters), in eval mode. Imports diffusers."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    made: Any = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                       pooled_projection_dim=8,
                                       axes_dims_rope=(2, 2, 4))  # type: ignore[no-untyped-call]
    made.eval()
    return made


def save_any(model: Any, directory: Path) -> Path:
    """Write a transformers or diffusers `model` with its ``save_pretrained``, in one file."""
    model.save_pretrained(directory)
    return directory
