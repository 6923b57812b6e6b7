"""The single-stack architectures of the new-user trial (Mistral, Phi-3, GPT-NeoX, OPT,
Falcon, Qwen3-MoE, DeepSeek-V3, Gemma 3, Mamba), tiny and random: every greedy `generate`
step's logits bit for bit equal to the resident model's, with prefetch and with on-demand
(the latter needs the exact routes of `offload.executors.ondemand`: Mamba's step takes
another matmul route for a weight that does not require grad)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from offload import OffloadConfig, Placement
from offload.hf import offload_model
from tests.hf.checkpoints import VOCAB, step_logits

STEPS = 4
_COMMON: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "max_position_embeddings": 64}

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "mistral": lambda: transformers.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=None),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, num_key_value_heads=2, pad_token_id=0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_COMMON),
    "opt": lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                          num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
    "falcon": lambda: transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                                num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, num_key_value_heads=2, num_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=16,
                                                     decoder_sparse_step=1),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_COMMON, num_key_value_heads=4, moe_intermediate_size=16,
                                                         n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                                         topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                                         q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                         v_head_dim=8, n_shared_experts=1),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_COMMON, num_key_value_heads=2, head_dim=8, sliding_window=16),
    # Wide enough that the two matmul routes round differently (see the module docstring).
    "mamba": lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=3,
                                              expand=2, conv_kernel=4),
}

BACKENDS = {
    "prefetch": OffloadConfig(group_size=1, prefetch_step=2),
    "on-demand": OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
}


def _build(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    made: Any = AutoModelForCausalLM.from_config(CONFIGS[arch]())  # type: ignore[no-untyped-call]
    made.eval()
    model: PreTrainedModel = made
    return model


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_generate_step_equals_the_resident_model(arch: str, backend: str) -> None:
    reference = _build(arch)
    model = copy.deepcopy(reference)
    off = offload_model(model, BACKENDS[backend])
    placements = {p.placement for p in off.plan.offloaded_params}
    assert placements == {Placement.PREFETCH if backend == "prefetch" else Placement.ON_DEMAND}
    want = step_logits(reference)
    got = step_logits(model)
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{arch} {backend}: step {step} differs by {(a - b).abs().max().item()}"
    off.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))
