"""Seven small random mixture-of-experts models built from `transformers` configs (nothing
is downloaded): Mixtral, Qwen3-MoE, Qwen2-MoE (a shared expert), DeepSeek-V3 (group
routing, a shared expert), OLMoE, gpt-oss (expert biases) and Llama 4 text (experts
served by the router's scores), with the experts counts and top-k of the real ones scaled
down, for the expert-cache tests and `benchmarks/bench_moe.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["MOE_ARCHITECTURES", "build_moe", "decode_logits", "implementations", "moe_config", "same_logits"]

VOCAB = 96


def _common(layers: int) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                pad_token_id=2)


#: Architecture -> (config of `layers` layers; its experts E and top-k).
MOE_ARCHITECTURES: dict[str, Callable[[int], PretrainedConfig]] = {
    "mixtral": lambda n: transformers.MixtralConfig(**_common(n), intermediate_size=48, num_local_experts=8,
                                                    num_experts_per_tok=2),
    "qwen3_moe": lambda n: transformers.Qwen3MoeConfig(**_common(n), num_experts=64, num_experts_per_tok=8,
                                                       moe_intermediate_size=16, intermediate_size=64),
    "qwen2_moe": lambda n: transformers.Qwen2MoeConfig(**_common(n), num_experts=16, num_experts_per_tok=4,
                                                       moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                                       intermediate_size=64),
    "deepseek_v3": lambda n: transformers.DeepseekV3Config(
        **{**_common(n), "num_key_value_heads": 4}, moe_intermediate_size=16, intermediate_size=64,
        n_routed_experts=64, num_experts_per_tok=8, n_group=4, topk_group=2, first_k_dense_replace=0,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_shared_experts=1),
    "olmoe": lambda n: transformers.OlmoeConfig(**_common(n), intermediate_size=16, num_experts=64,
                                                num_experts_per_tok=8),
    "gpt_oss": lambda n: transformers.GptOssConfig(**_common(n), intermediate_size=16, num_local_experts=32,
                                                   num_experts_per_tok=4, head_dim=8),
    "llama4": lambda n: transformers.Llama4TextConfig(**_common(n), intermediate_size=16,
                                                      intermediate_size_mlp=64, num_local_experts=16,
                                                      num_experts_per_tok=1, head_dim=8),
}


def implementations(name: str) -> tuple[str, ...]:
    """The experts implementations `name` can run: Llama 4's experts take no routing, only
    its own (``eager``)."""
    return ("eager",) if name == "llama4" else ("grouped_mm", "eager")


def moe_config(name: str, layers: int = 2, experts_implementation: str | None = None) -> PretrainedConfig:
    """The small config of `name` with `layers` layers; `experts_implementation` (``eager``,
    ``grouped_mm``, ``batched_mm``) where given, else transformers' default."""
    config = MOE_ARCHITECTURES[name](layers)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return config


def build_moe(name: str, layers: int = 2, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              experts_implementation: str | None = None) -> PreTrainedModel:
    """A random model of `name` in eval mode; the same seed gives the same weights."""
    torch.manual_seed(seed)
    # transformers leaves from_config unannotated: go through Any.
    model: Any = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        moe_config(name, layers, experts_implementation), dtype=dtype)
    # Experts left at their init (zeros in some) would route nothing interesting.
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "experts" in module_name or module_name.endswith(("gate.weight", "router.weight")):
                param.normal_(0.0, 0.2)
    made: PreTrainedModel = model.eval()
    return made


def decode_logits(model: Any, batch: int, *, seed: int = 5, prompt: int = 8, steps: int = 2) -> list[torch.Tensor]:
    """The logits of each forward of a greedy ``generate``: a `prompt`-token prefill (its
    last token's) and `steps` decode steps, with the KV cache."""
    ids = torch.randint(3, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                             min_new_tokens=steps + 1, do_sample=False, pad_token_id=2, output_logits=True,
                             return_dict_in_generate=True)
    return list(out.logits)


def same_logits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two runs of `decode_logits` are bit for bit equal."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
