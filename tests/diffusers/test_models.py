"""The diffusers transformers of the new-user trial (SD3, Wan; Flux is in
tests/hf/test_stacks.py), tiny and random, through `offload_model` on both backends: the
forward is the resident one bit for bit, and `restore` gives every weight back."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers import SD3Transformer2DModel, WanTransformer3DModel

from offload import OffloadConfig
from offload.hf import find_stacks, offload_model

BACKENDS = {"prefetch": OffloadConfig(group_size=1, prefetch_step=2),
            "on-demand": OffloadConfig(backend="uva", uva_max_bytes=1 << 40)}


def _sd3() -> tuple[Any, dict[str, torch.Tensor]]:
    model: Any = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                       caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
                                       pos_embed_max_size=16)  # type: ignore[no-untyped-call]
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
                   "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
                   "pooled_projections": torch.randn(1, 8, generator=g), "timestep": torch.tensor([3])}


def _wan() -> tuple[Any, dict[str, torch.Tensor]]:
    model: Any = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                       out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
                                       cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                       rope_max_seq_len=32)  # type: ignore[no-untyped-call]
    g = torch.Generator().manual_seed(1)
    return model, {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([3]),
                   "encoder_hidden_states": torch.randn(1, 5, 16, generator=g)}


MODELS: dict[str, Callable[[], tuple[Any, dict[str, torch.Tensor]]]] = {"sd3": _sd3, "wan": _wan}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_diffusers_transformer_runs_offloaded_bit_for_bit(name: str, backend: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    reference = copy.deepcopy(model)
    off = offload_model(model, BACKENDS[backend])
    assert off.plan.num_layers == sum(len(s) for s in find_stacks(model)) == 3
    assert off.plan.offloaded_params
    with torch.inference_mode():
        for _step in range(2):
            assert torch.equal(model(**inputs).sample, reference(**inputs).sample)
    off.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))
