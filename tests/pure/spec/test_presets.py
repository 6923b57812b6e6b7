"""Built-in presets against the published model sizes, derived here from the architecture.

Each expected count is computed from the models' published configurations (hidden size,
intermediate size, attention heads, key-value heads, layers, experts, vocabulary) with the
standard Llama / Mixtral layer layout, and then checked against the published total
parameter count once the embeddings and output head (which are not layers) are added.
"""

from __future__ import annotations

import attrs
import pytest

from offload.errors import PlanError
from offload.pure import (
    PRESETS,
    EnvSnapshot,
    ModelSpec,
    OffloadConfig,
    Platform,
    make_plan,
    preset_spec,
    segment_matches,
)
from offload.pure.spec.presets import preset_outside_bytes


@attrs.frozen(kw_only=True)
class Arch:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 0  # 0 = dense
    published_total: float  # parameters, as the model card states them


ARCHS: dict[str, Arch] = {
    # Meta Llama 3.1 8B: 8.03B parameters.
    "llama-8b": Arch(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                     published_total=8.03e9),
    # Meta Llama 3.1 70B: 70.6B parameters.
    "llama-70b": Arch(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256,
                      published_total=70.6e9),
    # Mixtral 8x7B: 46.7B parameters.
    "mixtral-8x7b": Arch(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, experts=8,
                         published_total=46.7e9),
}


def layer_params(a: Arch) -> int:
    """Parameters of one decoder layer: attention, MLP (or experts and router), two norms."""
    head_dim = a.hidden // a.heads
    attention = a.hidden * a.heads * head_dim * 2 + a.hidden * a.kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * a.hidden * a.intermediate  # gate, up, down
    if a.experts:
        mlp = a.experts * mlp + a.experts * a.hidden  # every expert, and the router
    return attention + mlp + 2 * a.hidden


def numel(spec: ModelSpec) -> int:
    return sum(p.numel for layer in spec.layers for p in layer.params)


def test_the_issue_presets_are_shipped() -> None:
    assert {"llama-8b", "llama-70b", "mixtral-8x7b"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_preset_parameter_count_follows_from_the_architecture(name: str) -> None:
    arch = ARCHS[name]
    spec = preset_spec(name)
    assert len(spec.layers) == arch.layers
    assert numel(spec) == arch.layers * layer_params(arch)
    for layer in spec.layers:
        assert sum(p.numel for p in layer.params) == layer_params(arch)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_preset_plus_embeddings_is_the_published_size(name: str) -> None:
    arch = ARCHS[name]
    # Untied input embedding and output head, and the final norm: not layers.
    outside_layers = 2 * arch.vocab * arch.hidden + arch.hidden
    total = numel(preset_spec(name)) + outside_layers
    assert abs(total - arch.published_total) / arch.published_total < 0.005


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_preset_outside_bytes_are_embedding_head_and_norm_in_bf16(name: str) -> None:
    arch = ARCHS[name]
    assert preset_outside_bytes(name) == 2 * (2 * arch.vocab * arch.hidden + arch.hidden)


def test_every_preset_has_outside_bytes() -> None:
    assert all(preset_outside_bytes(name) > 0 for name in PRESETS)


def test_llama_70b_outside_bytes_are_the_issues_3_9_gib() -> None:
    assert round(preset_outside_bytes("llama-70b") / 2**30, 2) == 3.91
    with pytest.raises(PlanError, match="no preset named 'gpt-5'"):
        preset_outside_bytes("gpt-5")


def test_llama_70b_decoder_layers_are_about_68_5_billion() -> None:
    assert abs(numel(preset_spec("llama-70b")) - 68.5e9) < 0.1e9


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_presets_are_bf16_contiguous_and_not_loaded(name: str) -> None:
    spec = preset_spec(name)
    for layer in spec.layers:
        for p in layer.params:
            assert p.dtype == "bfloat16"
            assert p.itemsize == 2
            assert p.device == "compute"
            assert p.storage_key is None
            assert p.nbytes == 2 * p.numel
    assert spec.nbytes == 2 * numel(spec)


def test_mixtral_has_fused_experts_a_filter_can_pick() -> None:
    spec = preset_spec("mixtral-8x7b")
    names = [p.name for p in spec.layers[0].params]
    picked = [n for n in names if segment_matches("experts.w2_weight", n)]
    assert len(picked) == 1
    arch = ARCHS["mixtral-8x7b"]
    (w2,) = [p for p in spec.layers[0].params if p.name == picked[0]]
    assert w2.numel == arch.experts * arch.hidden * arch.intermediate
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=1 << 50, param_filter=("experts.w2_weight",)),
                     EnvSnapshot(platform=Platform(has_cuda=True, device_total_bytes=80 << 30,
                                                   can_map_host_memory=True)))
    assert plan.offloaded_bytes == arch.layers * w2.nbytes


def test_presets_are_fresh_equal_values() -> None:
    assert preset_spec("llama-8b") == preset_spec("llama-8b")


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(PlanError) as caught:
        preset_spec("llama-7000b")
    assert "llama-7000b" in str(caught.value)
    for name in ARCHS:
        assert name in str(caught.value)


def test_mixtrals_experts_modules_are_listed_so_that_a_prefetch_plan_caches_them_as_a_load_would() -> None:
    """A loaded Mixtral's experts are found by shape and get expert caches by default; the
    preset plans the same: one experts module per layer, E 8, each expert its rows of w13
    and w2 in bf16."""
    spec = preset_spec("mixtral-8x7b")
    arch = ARCHS["mixtral-8x7b"]
    assert [g.layer for g in spec.experts] == list(range(arch.layers))
    for g in spec.experts:
        assert (g.module, g.num_experts) == ("block_sparse_moe.experts", arch.experts)
        assert g.params == ("block_sparse_moe.experts.w13_weight", "block_sparse_moe.experts.w2_weight")
        assert g.expert_bytes == 2 * (2 * arch.intermediate * arch.hidden + arch.hidden * arch.intermediate)
        assert g.top_k == 2  # Mixtral routes each token to 2 of its 8 experts
    plan = make_plan(spec, OffloadConfig(backend="prefetch", group_size=1, prefetch_step=2),
                     EnvSnapshot(platform=Platform(has_cuda=True, device_total_bytes=80 << 30,
                                                   can_map_host_memory=True)))
    assert [c.layer for c in plan.experts] == list(range(arch.layers))
    assert all(c.slots == 1 for c in plan.experts)  # the default C, E / 8
