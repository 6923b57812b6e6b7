"""Parsing safetensors headers and indexes (pure, no files); the stacks their tensors form
are `test_stacks.py`'s."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from offload.errors import CheckpointError
from offload.pure.spec.safetensors import (
    SAFETENSORS_DTYPES,
    TensorHeader,
    check_index,
    parse_safetensors_header,
    parse_safetensors_index,
    printable,
)
from offload.pure.spec.values import DTYPE_ITEMSIZE

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
