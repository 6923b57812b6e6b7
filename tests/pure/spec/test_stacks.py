"""Layer stacks found in a checkpoint's tensor names by structure (`offload.pure.spec.stacks`)."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given

from offload.errors import CheckpointError
from offload.pure.spec.stacks import CheckpointSpec, StackSpec, match_stack_order, spec_from_tensors
from offload.pure.spec.values import COMPUTE_DEVICE, contiguous_stride
from tests.pure.spec.test_safetensors import tensor

# ----------------------------------------------------------------------------- grouping

def test_llama_style_names_group_into_layers() -> None:
    tensors = [
        tensor("model.embed_tokens.weight", (32, 8)),
        tensor("model.norm.weight", (8,)),
        tensor("lm_head.weight", (32, 8)),
        *(tensor(f"model.layers.{i}.{p}", (8, 8)) for i in range(3)
          for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight")),
    ]
    random.Random(0).shuffle(tensors)
    result = spec_from_tensors(tensors)
    assert [(layer.index, layer.name) for layer in result.spec.layers] == [
        (0, "model.layers.0"), (1, "model.layers.1"), (2, "model.layers.2"),
    ]
    layer = result.spec.layers[1]
    assert [p.name for p in layer.params] == ["input_layernorm.weight", "mlp.up_proj.weight", "self_attn.q_proj.weight"]
    for param in layer.params:
        assert (param.shape, param.stride, param.dtype, param.itemsize) == ((8, 8), (8, 1), "bfloat16", 2)
        assert (param.storage_key, param.device, param.nbytes) == (None, COMPUTE_DEVICE, 128)
    assert [t.name for t in result.outside_layers] == [
        "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
    ]
    assert result.outside_bytes == 2 * 32 * 8 * 2 + 8 * 2
    assert result.spec.nbytes == 9 * 128


def test_gpt2_h_and_blocks_names_group_into_layers() -> None:
    gpt = spec_from_tensors([tensor("transformer.h.1.attn.c_attn.weight"), tensor("transformer.h.0.attn.c_attn.weight"),
                             tensor("transformer.wte.weight")])
    assert [(layer.name, [p.name for p in layer.params]) for layer in gpt.spec.layers] == [
        ("transformer.h.0", ["attn.c_attn.weight"]), ("transformer.h.1", ["attn.c_attn.weight"]),
    ]
    blocks = spec_from_tensors([tensor("blocks.0.norm1.weight"), tensor("blocks.0.attn.qkv.weight"),
                                tensor("pos_embed")])
    assert [(layer.name, [p.name for p in layer.params]) for layer in blocks.spec.layers] == [
        ("blocks.0", ["attn.qkv.weight", "norm1.weight"]),
    ]
    assert [t.name for t in blocks.outside_layers] == ["pos_embed"]


def test_indices_order_numerically() -> None:
    result = spec_from_tensors([tensor(f"model.layers.{i}.w") for i in range(12)])
    assert [layer.name for layer in result.spec.layers] == [f"model.layers.{i}" for i in range(12)]
    assert [layer.index for layer in result.spec.layers] == list(range(12))


def test_two_stacks_come_in_order_of_their_first_sorted_name() -> None:
    tensors = [tensor(f"model.vision.blocks.{i}.w") for i in range(2)] + [
        tensor(f"model.language.layers.{i}.w") for i in range(3)
    ]
    result = spec_from_tensors(reversed(tensors))
    assert [layer.name for layer in result.spec.layers] == [
        "model.language.layers.0", "model.language.layers.1", "model.language.layers.2",
        "model.vision.blocks.0", "model.vision.blocks.1",
    ]
    assert [layer.index for layer in result.spec.layers] == [0, 1, 2, 3, 4]


def test_only_the_first_layer_pair_counts() -> None:
    result = spec_from_tensors([tensor("model.layers.0.mlp.experts.h.3.w"), tensor("model.layers.0.blocks.1.w")])
    assert [(layer.name, [p.name for p in layer.params]) for layer in result.spec.layers] == [
        ("model.layers.0", ["blocks.1.w", "mlp.experts.h.3.w"]),
    ]


def test_names_that_only_look_like_layers_stay_outside() -> None:
    result = spec_from_tensors([
        tensor("model.layers.0.w"), tensor("model.layers.1.w"), tensor("model.layers.x.w"), tensor("model.layers.2"),
        tensor("model.layers.².w"), tensor("layers.0."), tensor("0.weight"), tensor("model.hh0.1.w"),
    ])
    assert [layer.name for layer in result.spec.layers] == ["model.layers.0", "model.layers.1"]
    assert [t.name for t in result.outside_layers] == [
        "0.weight", "layers.0.", "model.hh0.1.w", "model.layers.2", "model.layers.x.w", "model.layers.².w",
    ]


# Architectures by the names their checkpoints use: (tensor names, expected stacks as
# (name, first layer, layer count), expected tensors outside the layers).
def _names(stack: str, count: int, *params: str) -> list[str]:
    return [f"{stack}.{i}.{p}" for i in range(count) for p in params]


ARCHITECTURES: dict[str, tuple[list[str], list[tuple[str, int, int]], list[str]]] = {
    "llama": (
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
         *_names("model.layers", 3, "self_attn.q_proj.weight", "mlp.up_proj.weight")],
        [("model.layers", 0, 3)], ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"],
    ),
    "gpt2": (
        ["transformer.wte.weight", "transformer.ln_f.weight", *_names("transformer.h", 2, "attn.c_attn.weight")],
        [("transformer.h", 0, 2)], ["transformer.ln_f.weight", "transformer.wte.weight"],
    ),
    "bert": (
        ["bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight",
         *_names("bert.encoder.layer", 4, "attention.self.query.weight", "output.dense.weight")],
        [("bert.encoder.layer", 0, 4)], ["bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight"],
    ),
    "t5": (
        ["shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight",
         *_names("encoder.block", 3, "layer.0.SelfAttention.q.weight", "layer.1.DenseReluDense.wi.weight"),
         *_names("decoder.block", 2, "layer.0.SelfAttention.q.weight", "layer.1.EncDecAttention.q.weight",
                 "layer.2.DenseReluDense.wi.weight")],
        [("decoder.block", 0, 2), ("encoder.block", 2, 3)],
        ["decoder.final_layer_norm.weight", "encoder.final_layer_norm.weight", "shared.weight"],
    ),
    "diffusers transformer": (
        ["pos_embed.proj.weight", "proj_out.weight", *_names("transformer_blocks", 3, "attn1.to_q.weight",
                                                             "attn1.to_out.0.weight", "ff.net.2.weight")],
        [("transformer_blocks", 0, 3)], ["pos_embed.proj.weight", "proj_out.weight"],
    ),
    "mixtral experts": (
        [*_names("model.layers", 2, "block_sparse_moe.gate.weight",
                 *(f"block_sparse_moe.experts.{e}.w{w}.weight" for e in range(3) for w in (1, 2, 3)))],
        [("model.layers", 0, 2)], [],
    ),
    # Qwen2-VL: a vision tower and a merger whose nn.Sequential(Linear, GELU, Linear) numbers
    # its weights 0 and 2 (the GELU has none): a gap in leaf entries is not a stack.
    "qwen2-vl": (
        ["visual.merger.mlp.0.weight", "visual.merger.mlp.0.bias", "visual.merger.mlp.2.weight",
         *_names("visual.blocks", 2, "attn.qkv.weight"), *_names("model.layers", 3, "mlp.up_proj.weight")],
        [("model.layers", 0, 3), ("visual.blocks", 3, 2)],
        ["visual.merger.mlp.0.bias", "visual.merger.mlp.0.weight", "visual.merger.mlp.2.weight"],
    ),
    # A UNet's mid block holds one attention: a numbered prefix with a single entry is not a
    # stack when another has two or more.
    "unet mid block": (
        [*_names("down_blocks", 2, "resnets.0.conv1.weight"), "mid_block.attentions.0.proj_in.weight"],
        [("down_blocks", 0, 2)], ["mid_block.attentions.0.proj_in.weight"],
    ),
    # ... and when no prefix has two entries, every single one is a stack.
    "one layer each": (
        ["encoder.block.0.layer.0.w", "decoder.block.0.layer.0.w", "shared.weight"],
        [("decoder.block", 0, 1), ("encoder.block", 1, 1)], ["shared.weight"],
    ),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_layer_stacks_are_found_by_structure(arch: str) -> None:
    names, stacks, outside = ARCHITECTURES[arch]
    tensors = [tensor(name) for name in names]
    random.Random(1).shuffle(tensors)
    result = spec_from_tensors(tensors)
    assert [(s.name, s.first_layer, s.num_layers) for s in result.stacks] == stacks
    assert [t.name for t in result.outside_layers] == outside
    layers = result.spec.layers
    for stack in result.stacks:
        mine = layers[stack.first_layer:stack.first_layer + stack.num_layers]
        assert [layer.name for layer in mine] == [f"{stack.name}.{i}" for i in range(stack.num_layers)]
        assert stack.nbytes == sum(layer.nbytes for layer in mine)
    assert sum(s.num_layers for s in result.stacks) == len(layers)
    placed = sorted([f"{layer.name}.{p.name}" for layer in layers for p in layer.params] + outside)
    assert placed == sorted(names)


def test_moe_experts_stay_inside_their_layer() -> None:
    result = spec_from_tensors([tensor(f"model.layers.{i}.mlp.experts.{e}.w1.weight") for i in range(2)
                                for e in (0, 1, 7)])
    assert [(layer.name, [p.name for p in layer.params]) for layer in result.spec.layers] == [
        (f"model.layers.{i}", ["mlp.experts.0.w1.weight", "mlp.experts.1.w1.weight", "mlp.experts.7.w1.weight"])
        for i in range(2)
    ]


def test_a_gap_in_any_stack_of_blocks_names_the_missing_layer() -> None:
    with pytest.raises(CheckpointError) as caught:
        spec_from_tensors([tensor(f"bert.encoder.layer.{i}.attention.w") for i in (0, 1, 2, 5)])
    assert str(caught.value) == ("layer bert.encoder.layer.3 is missing: bert.encoder.layer has layers up to 5 "
                                 "but none numbered 3")
    assert (caught.value.name, caught.value.value) == ("bert.encoder.layer.3", 3)


def test_a_stack_name_with_a_newline_stays_on_one_line() -> None:
    with pytest.raises(CheckpointError) as caught:
        spec_from_tensors([tensor("a\nb.1.mlp.w")])
    assert str(caught.value).startswith("layer 'a\\nb.0' is missing: 'a\\nb' has layers up to 1")
    assert caught.value.name == "a\nb.0"


def test_leaf_entries_with_gaps_alone_are_no_layers_and_the_error_says_so() -> None:
    with pytest.raises(CheckpointError) as caught:
        spec_from_tensors([tensor("head.0.weight"), tensor("head.2.weight")])
    assert "no layers found" in str(caught.value)
    assert "'head' (no entry 1)" in str(caught.value)


def test_stacks_and_checkpoint_spec_validate_their_fields() -> None:
    result = spec_from_tensors([tensor("h.0.w"), tensor("h.1.w")])
    assert result.stacks == (StackSpec(name="h", first_layer=0, num_layers=2, nbytes=32),)
    with pytest.raises(CheckpointError, match="num_layers must be an integer >= 1, got 0"):
        StackSpec(name="h", first_layer=0, num_layers=0, nbytes=0)
    with pytest.raises(CheckpointError, match="stacks must be a tuple of StackSpec"):
        CheckpointSpec(spec=result.spec, outside_layers=(), stacks=[])  # type: ignore[arg-type]
    for wrong in [(StackSpec(name="h", first_layer=0, num_layers=1, nbytes=16),),
                  (StackSpec(name="g", first_layer=0, num_layers=2, nbytes=32),),
                  (StackSpec(name="h", first_layer=0, num_layers=2, nbytes=31),)]:
        with pytest.raises(CheckpointError, match="stacks do not describe the layers"):
            CheckpointSpec(spec=result.spec, outside_layers=(), stacks=wrong)


def test_a_gap_names_the_missing_layer() -> None:
    with pytest.raises(CheckpointError) as caught:
        spec_from_tensors([tensor(f"model.layers.{i}.mlp.w") for i in (0, 1, 3)])
    assert str(caught.value) == "layer model.layers.2 is missing: model.layers has layers up to 3 but none numbered 2"
    assert (caught.value.name, caught.value.value) == ("model.layers.2", 2)


def test_a_stack_not_starting_at_zero_names_layer_zero() -> None:
    with pytest.raises(CheckpointError, match="layer h.0 is missing") as caught:
        spec_from_tensors([tensor("h.1.attn.w"), tensor("h.2.attn.w")])
    assert caught.value.name == "h.0"


def test_no_layers_is_an_error_that_says_what_was_looked_for() -> None:
    with pytest.raises(CheckpointError) as caught:
        spec_from_tensors([tensor("embed.weight"), tensor("head.weight")])
    message = str(caught.value)
    assert "<stack>.<N>.<name>" in message and "among 2" in message and "embed.weight" in message
    assert caught.value.value == ("embed.weight", "head.weight")
    with pytest.raises(CheckpointError, match="among 0"):
        spec_from_tensors([])


def test_duplicate_names_and_two_spellings_of_one_layer_are_errors() -> None:
    with pytest.raises(CheckpointError, match="tensor 'layers.0.w' appears twice"):
        spec_from_tensors([tensor("layers.0.w"), tensor("layers.0.w")])
    with pytest.raises(CheckpointError, match="'layers.01' and 'layers.1' name the same layer") as caught:
        spec_from_tensors([tensor("layers.0.w"), tensor("layers.01.a"), tensor("layers.1.b")])
    assert caught.value.name == "layers.1"


def test_checkpoint_spec_validates_its_fields() -> None:
    result = spec_from_tensors([tensor("h.0.w")])
    with pytest.raises(CheckpointError, match="outside_layers must be a tuple of TensorHeader"):
        CheckpointSpec(spec=result.spec, outside_layers=[tensor("x")], stacks=result.stacks)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="spec must be a ModelSpec"):
        CheckpointSpec(spec=None, outside_layers=(), stacks=())  # type: ignore[arg-type]


_PARAM_NAMES = st.lists(st.sampled_from(["w", "b", "mlp.up.weight", "attn.q.weight", "norm.weight",
                                         "mlp.experts.3.w1.weight", "layer.0.SelfAttention.q.weight"]),
                        min_size=1, max_size=4, unique=True)
_STACK_NAMES = ["model.layers", "transformer.h", "vision.blocks", "blocks", "encoder.layer", "decoder.block",
                "transformer_blocks"]


@given(
    stacks=st.lists(st.tuples(st.sampled_from(_STACK_NAMES), st.integers(1, 12), _PARAM_NAMES),
                    min_size=1, max_size=3, unique_by=lambda s: s[0]),
    outside=st.lists(st.sampled_from(["embed.weight", "lm_head.weight", "norm.weight"]), unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_tensor_is_placed_once_whatever_the_input_order(
    stacks: list[tuple[str, int, list[str]]], outside: list[str], seed: int,
) -> None:
    tensors = [tensor(f"{stack}.{i}.{p}", (i + 1, 3)) for stack, count, params in stacks
               for i in range(count) for p in params] + [tensor(name) for name in outside]
    shuffled = list(tensors)
    random.Random(seed).shuffle(shuffled)
    result = spec_from_tensors(shuffled)
    assert result == spec_from_tensors(tensors)
    # A single-layer prefix is a stack only when no prefix has two or more layers.
    kept = [s for s in stacks if s[1] >= 2] or stacks
    dropped = [f"{stack}.0.{p}" for stack, count, params in stacks if (stack, count, params) not in kept
               for p in params]
    assert [s.name for s in result.stacks] == sorted((s[0] for s in kept), key=lambda name: name + ".")
    assert [s.num_layers for s in result.stacks] == [dict((s[0], s[1]) for s in kept)[x.name] for x in result.stacks]
    placed = [f"{layer.name}.{p.name}" for layer in result.spec.layers for p in layer.params]
    assert sorted(placed + [t.name for t in result.outside_layers]) == sorted(t.name for t in tensors)
    assert [layer.index for layer in result.spec.layers] == list(range(sum(count for _, count, _ in kept)))
    assert [t.name for t in result.outside_layers] == sorted(outside + dropped)
    for layer in result.spec.layers:
        index = int(layer.name.rsplit(".", 1)[1])
        assert [p.name for p in layer.params] == sorted(p.name for p in layer.params)
        assert all(p.shape == (index + 1, 3) and p.stride == contiguous_stride(p.shape) for p in layer.params)



# ----------------------------------------------------------------------------- buffers

def test_named_buffers_are_taken_out_of_the_layers_and_kept_on_the_device() -> None:
    names = [f"model.layers.{i}.{leaf}" for i in range(2) for leaf in ("mlp.up.weight", "mlp.gate.bias_correction")]
    buffer_names = {f"model.layers.{i}.mlp.gate.bias_correction" for i in range(2)}
    result = spec_from_tensors([tensor(n) for n in [*names, "lm_head.weight"]], buffers=buffer_names)
    assert [p.name for layer in result.spec.layers for p in layer.params] == ["mlp.up.weight", "mlp.up.weight"]
    assert [t.name for t in result.buffers] == sorted(buffer_names)
    assert [t.name for t in result.outside_layers] == ["lm_head.weight"]
    # Everything not planned stays on the device: the tensors outside the layers and the buffers.
    assert result.outside_bytes == sum(t.nbytes for t in (*result.outside_layers, *result.buffers))
    assert result.buffer_bytes == sum(t.nbytes for t in result.buffers) > 0


def test_without_buffers_named_every_layer_tensor_is_a_parameter() -> None:
    names = [f"model.layers.{i}.{leaf}" for i in range(2) for leaf in ("w", "b")]
    result = spec_from_tensors([tensor(n) for n in names])
    assert result.buffers == () and result.buffer_bytes == 0
    assert sum(len(layer.params) for layer in result.spec.layers) == 4


def test_buffer_names_absent_from_the_checkpoint_change_nothing() -> None:
    names = [f"h.{i}.w" for i in range(3)]
    plain = spec_from_tensors([tensor(n) for n in names])
    assert spec_from_tensors([tensor(n) for n in names], buffers={"h.0.rotary.inv_freq"}) == plain


def test_the_checkpoints_stacks_follow_the_order_the_model_runs() -> None:
    found = [("language_model.model.layers", 2), ("vision_tower.encoder.layers", 2), ("extra.blocks", 3)]
    running = [("model.vision_tower.encoder.layers", 2), ("model.language_model.layers", 2)]
    # A suffix, then the same segments in another order; unmatched stacks are left out.
    assert match_stack_order(found, running) == ("vision_tower.encoder.layers", "language_model.model.layers")
    assert match_stack_order(found, [("model.language_model.layers", 5)]) == ()  # another layer count
    names = [f"{stack}.{i}.w" for stack, n in (("b.layers", 2), ("a.layers", 3)) for i in range(n)]
    result = spec_from_tensors([tensor(n) for n in names], running=(("b.layers", 2), ("a.layers", 3)))
    assert [s.name for s in result.stacks] == ["b.layers", "a.layers"] and result.spec.stacks == (2, 3)
    assert [s.name for s in spec_from_tensors([tensor(n) for n in names]).stacks] == ["a.layers", "b.layers"]
