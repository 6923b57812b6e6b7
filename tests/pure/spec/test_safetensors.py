"""Parsing safetensors headers and grouping their tensors into layers (pure, no files)."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from offload.errors import CheckpointError
from offload.pure.spec.safetensors import (
    SAFETENSORS_DTYPES,
    CheckpointSpec,
    StackSpec,
    TensorHeader,
    check_index,
    parse_safetensors_header,
    parse_safetensors_index,
    printable,
    spec_from_tensors,
)
from offload.pure.spec.values import COMPUTE_DEVICE, DTYPE_ITEMSIZE, contiguous_stride

ITEMSIZE_BY_CODE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4,
                    "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}


def entry(code: str, shape: list[int], begin: int = 0) -> dict[str, Any]:
    """A well-formed header entry whose range starts at `begin`."""
    return {"dtype": code, "shape": shape, "data_offsets": [begin, begin + math.prod(shape) * ITEMSIZE_BY_CODE[code]]}


def header(entries: dict[str, Any]) -> bytes:
    return json.dumps(entries).encode()


def tensor(name: str, shape: tuple[int, ...] = (4, 2), dtype: str = "bfloat16") -> TensorHeader:
    return TensorHeader(name=name, dtype=dtype, shape=shape, begin=0, end=math.prod(shape) * DTYPE_ITEMSIZE[dtype])


def parse_error(raw: bytes, data_bytes: int | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        parse_safetensors_header(raw, source="shard.safetensors", data_bytes=data_bytes)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("shard.safetensors: ")
    return caught.value


# ----------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize(
    ("code", "name", "itemsize"),
    [
        ("F64", "float64", 8), ("F32", "float32", 4), ("F16", "float16", 2), ("BF16", "bfloat16", 2),
        ("I64", "int64", 8), ("I32", "int32", 4), ("I16", "int16", 2), ("I8", "int8", 1),
        ("U64", "uint64", 8), ("U32", "uint32", 4), ("U16", "uint16", 2), ("U8", "uint8", 1),
        ("BOOL", "bool", 1), ("F8_E4M3", "float8_e4m3fn", 1), ("F8_E5M2", "float8_e5m2", 1),
        ("F8_E8M0", "float8_e8m0fnu", 1), ("C64", "complex64", 8),
    ],
)
def test_dtype_table(code: str, name: str, itemsize: int) -> None:
    raw = header({"w": {"dtype": code, "shape": [3, 5], "data_offsets": [16, 16 + 15 * itemsize]}})
    (parsed,) = parse_safetensors_header(raw, source="f", data_bytes=16 + 15 * itemsize)
    assert parsed == TensorHeader(name="w", dtype=name, shape=(3, 5), begin=16, end=16 + 15 * itemsize)
    assert (parsed.itemsize, parsed.numel, parsed.nbytes) == (itemsize, 15, 15 * itemsize)
    assert SAFETENSORS_DTYPES[code] == name


def test_dtype_table_is_complete_and_sized() -> None:
    assert set(SAFETENSORS_DTYPES) == set(ITEMSIZE_BY_CODE)
    for code, name in SAFETENSORS_DTYPES.items():
        assert DTYPE_ITEMSIZE[name] == ITEMSIZE_BY_CODE[code]


# ----------------------------------------------------------------------------- parsing

def test_parse_sorts_by_name_skips_metadata_and_accepts_padding() -> None:
    raw = header({
        "__metadata__": {"format": "pt"},
        "b": entry("F32", [2], 0),
        "a": entry("I8", [0], 8),
        "c": entry("BF16", [], 8),
    }) + b"     "
    parsed = parse_safetensors_header(raw, source="f", data_bytes=10)
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in parsed] == [
        ("a", "int8", (0,), 8, 8),
        ("b", "float32", (2,), 0, 8),
        ("c", "bfloat16", (), 8, 10),
    ]


def test_parse_empty_object_gives_no_tensors() -> None:
    assert parse_safetensors_header(b"{}", source="f", data_bytes=0) == ()
    assert parse_safetensors_header(b'{"__metadata__": {}}', source="f", data_bytes=None) == ()


def test_data_bytes_none_skips_the_size_check() -> None:
    (parsed,) = parse_safetensors_header(header({"w": entry("F32", [1 << 20])}), source="f", data_bytes=None)
    assert parsed.end == 4 << 20


@pytest.mark.parametrize(
    ("raw", "fragment", "name"),
    [
        (b"{not json", "header is not valid JSON: Expecting property name enclosed in double quotes at byte 1",
         "shard.safetensors"),
        (b"", "header is not valid JSON: Expecting value at byte 0", "shard.safetensors"),
        (b'{"w": NaN}', "header is not valid JSON: NaN is not a JSON number", "shard.safetensors"),
        (b"\xff\xfe{}", "header is not UTF-8 text (byte 0)", "shard.safetensors"),
        (b"[1, 2]", "header must be a JSON object, got list", "shard.safetensors"),
        (b'"text"', "header must be a JSON object, got str", "shard.safetensors"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', "header names 'a' twice", "a"),
        (b"[" * 100_000 + b"]" * 100_000, "header is not usable JSON: RecursionError", "shard.safetensors"),
    ],
)
def test_junk_headers_are_refused(raw: bytes, fragment: str, name: str) -> None:
    error = parse_error(raw)
    assert str(error).startswith(f"shard.safetensors: {fragment}")
    assert error.name == name


def test_unknown_dtype_is_named() -> None:
    error = parse_error(header({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}))
    assert "tensor 'w'" in str(error)
    assert "unknown dtype 'F4'" in str(error)
    assert "BF16" in str(error)  # the known codes are listed
    assert (error.name, error.value) == ("w", "F4")


@pytest.mark.parametrize("shape", [[-1, 2], [2.0], [True], "4x4", None, [[2]]])
def test_bad_shape_is_named(shape: object) -> None:
    error = parse_error(header({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}))
    assert "shape must be a list of integers >= 0" in str(error)
    assert (error.name, error.value) == ("w", shape)


@pytest.mark.parametrize("offsets", [[0], [0, 8, 16], [-8, 0], [0.0, 8.0], "0-8", [False, 8], None])
def test_malformed_offsets_are_named(offsets: object) -> None:
    error = parse_error(header({"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}))
    assert "data_offsets must be [begin, end]" in str(error)
    assert (error.name, error.value) == ("w", offsets)


@pytest.mark.parametrize("offsets", [[0, 4], [0, 12], [8, 0], [4, 4]])
def test_offsets_that_do_not_span_the_tensor_are_named(offsets: list[int]) -> None:
    error = parse_error(header({"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}))
    assert f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but F32 [2] needs 8" in str(error)
    assert (error.name, error.value) == ("w", offsets)


def test_offsets_past_the_data_are_named() -> None:
    raw = header({"w": entry("BF16", [4, 4], 32)})
    assert parse_safetensors_header(raw, source="f", data_bytes=64)[0].end == 64
    error = parse_error(raw, data_bytes=63)
    assert "data_offsets [32, 64] end past the 63 bytes of data" in str(error)
    assert (error.name, error.value) == ("w", [32, 64])


def test_overlapping_ranges_are_refused_but_empty_tensors_may_share_an_offset() -> None:
    ok = header({"a": entry("F32", [2], 0), "b": entry("F32", [0], 4), "c": entry("F32", [1], 8)})
    assert len(parse_safetensors_header(ok, source="f", data_bytes=12)) == 3
    error = parse_error(header({"a": entry("F32", [2], 0), "b": entry("F32", [2], 4)}))
    assert "tensors 'a' [0, 8) and 'b' [4, 12) overlap" in str(error)
    assert (error.name, error.value) == ("b", (4, 12))


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ([1, 2], "entry must be a JSON object"),
        ({"dtype": "F32", "shape": [1]}, "entry has no 'data_offsets'"),
        ({"shape": [1], "data_offsets": [0, 4]}, "entry has no 'dtype'"),
    ],
)
def test_malformed_entries_are_named(item: object, fragment: str) -> None:
    error = parse_error(header({"w": item}))
    assert f"tensor 'w': {fragment}" in str(error)
    assert error.name == "w"


def test_long_values_are_cut_in_messages() -> None:
    error = parse_error(header({"w": {"dtype": "F32", "shape": [-1] * 1000, "data_offsets": [0, 4]}}))
    assert len(str(error)) < 200
    assert error.value == [-1] * 1000


def test_tensor_header_validates_itself() -> None:
    with pytest.raises(CheckpointError, match="holds 7 bytes, but bfloat16 \\[2\\] needs 4"):
        TensorHeader(name="w", dtype="bfloat16", shape=(2,), begin=0, end=7)
    with pytest.raises(CheckpointError, match="dtype must be a dtype name"):
        TensorHeader(name="w", dtype="BF16", shape=(2,), begin=0, end=4)
    with pytest.raises(CheckpointError, match="name must be a non-empty string"):
        TensorHeader(name="", dtype="int8", shape=(2,), begin=0, end=2)


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


# ----------------------------------------------------------------------------- the index

def index_error(raw: bytes) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        parse_safetensors_index(raw, source="model.safetensors.index.json")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("model.safetensors.index.json: ")
    return caught.value


def test_an_index_gives_its_weight_map_sorted_and_read_only() -> None:
    raw = json.dumps({"metadata": {"total_size": 10}, "weight_map": {
        "b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors"}}).encode()
    weight_map = parse_safetensors_index(raw, source="i")
    assert list(weight_map.items()) == [("a", "model-00001-of-00002.safetensors"),
                                        ("b", "model-00002-of-00002.safetensors")]
    with pytest.raises(TypeError):
        weight_map["c"] = "x.safetensors"  # type: ignore[index]


@pytest.mark.parametrize(
    ("raw", "fragment", "name"),
    [
        (b"{oops", "index is not valid JSON", "model.safetensors.index.json"),
        (b"\xff", "index is not UTF-8 text", "model.safetensors.index.json"),
        (b"[]", "index must be a JSON object, got list", "model.safetensors.index.json"),
        (b"{}", "index has no 'weight_map' object", "model.safetensors.index.json"),
        (b'{"weight_map": []}', "index has no 'weight_map' object", "model.safetensors.index.json"),
        (b'{"weight_map": {}}', "index's 'weight_map' names no tensors", "model.safetensors.index.json"),
        (b'{"weight_map": {"": "a.safetensors"}}', "maps an empty tensor name", "model.safetensors.index.json"),
        (b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "index names 'w' twice", "w"),
        (b'{"weight_map": {"w": 3}}', "weight_map['w'] must be a file name string, got 3", "w"),
        (b'{"weight_map": {"w": "../a.safetensors"}}', "weight_map['w'] = '../a.safetensors' is not a file name", "w"),
        (b'{"weight_map": {"w": "sub/a.safetensors"}}', "= 'sub/a.safetensors' is not a file name", "w"),
        (b'{"weight_map": {"w": "sub\\\\a.safetensors"}}', "is not a file name in the index's directory", "w"),
        (b'{"weight_map": {"w": ".."}}', "weight_map['w'] = '..' is not a file name", "w"),
        (b'{"weight_map": {"w": ""}}', "weight_map['w'] = '' is not a file name", "w"),
        (b'{"weight_map": {"w": "a.bin"}}', "weight_map['w'] = 'a.bin' is not a .safetensors file", "w"),
    ],
)
def test_a_malformed_index_is_refused(raw: bytes, fragment: str, name: str) -> None:
    error = index_error(raw)
    assert fragment in str(error)
    assert error.name == name


@pytest.mark.parametrize(
    ("found", "message", "name"),
    [
        ({"a": "1.safetensors", "b": "2.safetensors"}, None, None),
        ({"a": "1.safetensors", "b": "1.safetensors"},
         "i: tensor 'b' is mapped to 2.safetensors but is in 1.safetensors", "b"),
        ({"a": "1.safetensors"}, "i: tensor 'b' is mapped to 2.safetensors, which does not hold it", "b"),
        ({"a": "1.safetensors", "b": "2.safetensors", "c": "2.safetensors"},
         "i: tensor 'c' is in 2.safetensors but the index does not name it", "c"),
        ({"a": "1.safetensors", "b": "2\nx.safetensors"},
         "i: tensor 'b' is mapped to 2.safetensors but is in '2\\nx.safetensors'", "b"),
    ],
)
def test_the_index_is_checked_against_the_shards(found: dict[str, str], message: str | None,
                                                 name: str | None) -> None:
    weight_map = {"a": "1.safetensors", "b": "2.safetensors"}
    if message is None:
        check_index(weight_map, found, source="i")
        return
    with pytest.raises(CheckpointError) as caught:
        check_index(weight_map, found, source="i")
    assert str(caught.value) == message
    assert caught.value.name == name


@pytest.mark.parametrize(("text", "shown"), [("a b.safetensors", "a b.safetensors"),
                                             ("a\nb", "'a\\nb'"), ("a\x1bb", "'a\\x1bb'")])
def test_printable_escapes_only_what_would_break_a_line(text: str, shown: str) -> None:
    assert printable(text) == shown
