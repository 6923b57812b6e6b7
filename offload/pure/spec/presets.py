"""Built-in model shapes for `offload plan` without a checkpoint: shapes only, no weights.

Shapes are those of the public configurations (hidden size, intermediate size, heads,
key-value heads, layers, vocabulary), decoder layers only: embeddings, the final norm and
the output head are not layers and are not offloaded; `preset_outside_bytes` gives their
bytes, which stay on the device (and which `fit` counts). All weights are bf16 and not yet loaded
(device `COMPUTE_DEVICE`). The MoE preset uses the fused expert layout inference engines
load (``experts.w13_weight`` for gate and up, ``experts.w2_weight`` for down), so that
filters like ``experts.w2_weight`` can be tried on it, and lists its experts modules, so
that a prefetch plan gives each offloaded one the expert cache a loaded model's gets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from offload.errors import PlanError
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = ["PRESETS", "llama_spec", "mixtral_spec", "preset_outside_bytes", "preset_spec"]


def _param(name: str, *shape: int) -> ParamSpec:
    return ParamSpec(name=name, shape=shape, stride=contiguous_stride(shape), dtype="bfloat16", itemsize=2)


def _attention(hidden: int, heads: int, kv_heads: int) -> list[ParamSpec]:
    head_dim = hidden // heads
    return [
        _param("input_layernorm.weight", hidden),
        _param("self_attn.q_proj.weight", heads * head_dim, hidden),
        _param("self_attn.k_proj.weight", kv_heads * head_dim, hidden),
        _param("self_attn.v_proj.weight", kv_heads * head_dim, hidden),
        _param("self_attn.o_proj.weight", hidden, heads * head_dim),
        _param("post_attention_layernorm.weight", hidden),
    ]


def llama_spec(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> ModelSpec:
    """A dense Llama-style decoder: attention with grouped KV heads and a gated MLP."""
    params = (
        *_attention(hidden, heads, kv_heads),
        _param("mlp.gate_proj.weight", intermediate, hidden),
        _param("mlp.up_proj.weight", intermediate, hidden),
        _param("mlp.down_proj.weight", hidden, intermediate),
    )
    return ModelSpec(
        layers=tuple(LayerSpec(index=i, name=f"model.layers.{i}", params=params) for i in range(layers))
    )


def mixtral_spec(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, experts: int,
                 top_k: int | None = None) -> ModelSpec:
    """A Mixtral-style MoE decoder with fused expert weights, its experts modules listed
    (`ModelSpec.experts`: each layer's ``block_sparse_moe.experts``, routed by indices, each
    token to `top_k` of them), as `describe_layers` lists a loaded one's."""
    fused = (
        _param("block_sparse_moe.experts.w13_weight", experts, 2 * intermediate, hidden),
        _param("block_sparse_moe.experts.w2_weight", experts, hidden, intermediate),
    )
    params = (*_attention(hidden, heads, kv_heads), _param("block_sparse_moe.gate.weight", experts, hidden), *fused)
    groups = tuple(
        ExpertGroup(layer=i, module="block_sparse_moe.experts", num_experts=experts,
                    params=tuple(p.name for p in fused), expert_bytes=sum(p.nbytes for p in fused) // experts,
                    routing=Routing.INDICES, top_k=top_k)
        for i in range(layers))
    return ModelSpec(
        layers=tuple(LayerSpec(index=i, name=f"model.layers.{i}", params=params) for i in range(layers)),
        experts=groups,
    )


#: Preset name -> builder. Shapes from the models' published configurations.
PRESETS: Mapping[str, Callable[[], ModelSpec]] = {
    # Llama 3.1 8B: 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads.
    "llama-8b": lambda: llama_spec(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8),
    # Llama 3.1 70B: 80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads.
    "llama-70b": lambda: llama_spec(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8),
    # Mixtral 8x7B: 32 layers, hidden 4096, expert intermediate 14336, 32 heads, 8 KV heads,
    # 8 experts, 2 per token.
    "mixtral-8x7b": lambda: mixtral_spec(
        layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8, top_k=2
    ),
}


#: Preset name -> (vocabulary, hidden size) from the same configurations: the shapes of
#: what lies outside the decoder layers. All three untie the embedding and the head.
_OUTSIDE: Mapping[str, tuple[int, int]] = {
    "llama-8b": (128256, 4096),
    "llama-70b": (128256, 8192),
    "mixtral-8x7b": (32000, 4096),
}
_BF16 = 2


def _unknown(name: str) -> PlanError:
    return PlanError(f"no preset named {name!r}; presets: {', '.join(sorted(PRESETS))}", name="preset", value=name)


def preset_outside_bytes(name: str) -> int:
    """Bytes of a preset's weights outside its decoder layers, in bf16: the input embedding
    (vocabulary x hidden), the untied output head (vocabulary x hidden) and the final norm
    (hidden). They stay on the device.

    Raises:
        PlanError: no preset has that name; the message lists the ones there are.
    """
    if name not in _OUTSIDE:
        raise _unknown(name)
    vocab, hidden = _OUTSIDE[name]
    return _BF16 * (2 * vocab * hidden + hidden)


def preset_spec(name: str) -> ModelSpec:
    """The spec of a built-in preset.

    Raises:
        PlanError: no preset has that name; the message lists the ones there are.
    """
    builder = PRESETS.get(name)
    if builder is None:
        raise _unknown(name)
    return builder()
