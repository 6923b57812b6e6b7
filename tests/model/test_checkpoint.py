"""Reading model shapes from real safetensors files on disk, headers only."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from offload.errors import CheckpointError
from offload.model.checkpoint import (
    MAX_HEADER_BYTES,
    checkpoint_files,
    read_checkpoint,
    read_safetensors_header,
    spec_from_checkpoint,
)
from offload.pure.spec.safetensors import SAFETENSORS_DTYPES, TensorHeader
from offload.pure.spec.values import COMPUTE_DEVICE, DTYPE_ITEMSIZE

ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "F16": 2}
GIB = 1 << 30

Tensors = dict[str, tuple[str, tuple[int, ...]]]


def write_safetensors(path: Path, tensors: Tensors, *, data_bytes: int | None = None) -> dict[str, tuple[int, int]]:
    """Write a safetensors file by hand: length, JSON header, zero data. Returns each byte range.

    With `data_bytes`, the data section is that long (sparse where it is past the tensors).
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    ranges: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, (code, shape) in tensors.items():
        size = math.prod(shape) * ITEMSIZE[code]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        ranges[name] = (offset, offset + size)
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # writers pad the header to 8 bytes
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        if data_bytes is None:
            file.write(bytes(offset))
        else:
            file.truncate(8 + len(raw) + data_bytes)
    return ranges


def layer_tensors(index: int, code: str = "BF16") -> Tensors:
    return {
        f"model.layers.{index}.input_layernorm.weight": (code, (64,)),
        f"model.layers.{index}.self_attn.q_proj.weight": (code, (64, 64)),
        f"model.layers.{index}.mlp.down_proj.weight": (code, (64, 128)),
    }


@pytest.fixture
def two_shards(tmp_path: Path) -> Path:
    first: Tensors = {"model.embed_tokens.weight": ("BF16", (100, 64)), **layer_tensors(0), **layer_tensors(1)}
    second: Tensors = {
        **layer_tensors(2),
        "model.layers.2.mlp.down_proj.weight_scale": ("F32", (64, 1)),
        "model.norm.weight": ("BF16", (64,)),
        "lm_head.weight": ("F8_E4M3", (100, 64)),
    }
    # Layer 2's weights in FP8 to check that element sizes come from the header dtype.
    second.update({name: ("F8_E4M3", shape) for name, (_, shape) in layer_tensors(2).items()})
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", first)
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", second)
    write_index(tmp_path, {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second})
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def write_index(folder: Path, shards: dict[str, Tensors], name: str = "model.safetensors.index.json") -> Path:
    """The index a sharded writer leaves beside its shards: tensor name -> shard file."""
    weight_map = {tensor: shard for shard, tensors in shards.items() for tensor in tensors}
    path = folder / name
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def test_two_shards_read_end_to_end(two_shards: Path) -> None:
    result = read_checkpoint(two_shards)
    spec = result.spec
    assert [(layer.index, layer.name) for layer in spec.layers] == [
        (0, "model.layers.0"), (1, "model.layers.1"), (2, "model.layers.2"),
    ]
    expected_bf16 = [("input_layernorm.weight", (64,), 128), ("mlp.down_proj.weight", (64, 128), 16384),
                     ("self_attn.q_proj.weight", (64, 64), 8192)]
    for layer in spec.layers[:2]:
        assert [(p.name, p.shape, p.nbytes) for p in layer.params] == expected_bf16
        assert {(p.dtype, p.itemsize, p.device, p.storage_key) for p in layer.params} == {
            ("bfloat16", 2, COMPUTE_DEVICE, None)
        }
    assert [(p.name, p.shape, p.dtype, p.nbytes) for p in spec.layers[2].params] == [
        ("input_layernorm.weight", (64,), "float8_e4m3fn", 64),
        ("mlp.down_proj.weight", (64, 128), "float8_e4m3fn", 8192),
        ("mlp.down_proj.weight_scale", (64, 1), "float32", 256),
        ("self_attn.q_proj.weight", (64, 64), "float8_e4m3fn", 4096),
    ]
    assert spec.nbytes == 2 * (128 + 16384 + 8192) + (64 + 8192 + 256 + 4096)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in result.outside_layers] == [
        ("lm_head.weight", "float8_e4m3fn", (100, 64), 6400),
        ("model.embed_tokens.weight", "bfloat16", (100, 64), 12800),
        ("model.norm.weight", "bfloat16", (64,), 128),
    ]
    assert result.outside_bytes == 6400 + 12800 + 128
    assert spec_from_checkpoint(str(two_shards)) == spec


def test_byte_ranges_are_those_written(tmp_path: Path) -> None:
    tensors: Tensors = {"b": ("F32", (3, 2)), "a": ("I8", (5,)), "c": ("F16", (0, 4))}
    ranges = write_safetensors(tmp_path / "one.safetensors", tensors)
    parsed = read_safetensors_header(tmp_path / "one.safetensors")
    assert [t.name for t in parsed] == ["a", "b", "c"]
    assert {t.name: (t.begin, t.end) for t in parsed} == ranges == {"b": (0, 24), "a": (24, 29), "c": (29, 29)}


def test_a_single_file_is_a_checkpoint(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {**layer_tensors(0), **layer_tensors(1)})
    spec = spec_from_checkpoint(tmp_path / "model.safetensors")
    assert [layer.name for layer in spec.layers] == ["model.layers.0", "model.layers.1"]
    assert checkpoint_files(tmp_path / "model.safetensors") == (tmp_path / "model.safetensors",)


def test_files_are_listed_sorted_and_only_safetensors(tmp_path: Path) -> None:
    for name in ("b.safetensors", "a.safetensors", "c.bin", "notes.json"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.safetensors").mkdir()
    assert checkpoint_files(tmp_path) == (tmp_path / "a.safetensors", tmp_path / "b.safetensors")


def test_the_data_is_never_read(tmp_path: Path) -> None:
    # 6 GiB of sparse data: reading it would take seconds and show in the process's I/O.
    path = tmp_path / "huge.safetensors"
    write_safetensors(path, {"model.layers.0.w": ("BF16", (3 * GIB,))}, data_bytes=6 * GIB)
    assert path.stat().st_size > 6 * GIB
    (header_bytes,) = struct.unpack("<Q", _first_8(path))
    io = Path("/proc/self/io")
    baseline = _bytes_read(io)  # what reading /proc/self/io itself adds to the count
    before = _bytes_read(io)
    start = time.perf_counter()
    spec = spec_from_checkpoint(tmp_path)
    elapsed = time.perf_counter() - start
    after = _bytes_read(io)
    assert spec.layers[0].params[0].nbytes == 6 * GIB
    assert elapsed < 1.0
    if baseline is not None and before is not None and after is not None:
        # Exactly the length field and the header (plus slack for the count's own digits);
        # a buffered reader would have pulled in kilobytes of data after the header.
        overhead = before - baseline
        assert after - before - overhead <= 8 + header_bytes + 256, f"read {after - before - overhead} bytes"


def _first_8(path: Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(8)


def _bytes_read(io: Path) -> int | None:
    """Bytes this process has read through read(2) and friends (Linux), or None."""
    try:
        lines = io.read_text().splitlines()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in lines if line.startswith("rchar:"))


def test_per_file_progress_is_logged_at_debug(two_shards: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="offload.load"):
        read_checkpoint(two_shards)
    messages = [r.getMessage() for r in caplog.records if r.name == "offload.load"]
    assert {r.levelno for r in caplog.records} == {logging.DEBUG}
    assert any("model-00001-of-00002.safetensors: 7 tensors" in m for m in messages)
    assert any("model-00002-of-00002.safetensors: 6 tensors" in m for m in messages)
    assert any("2 files, 3 layers, 3 tensors outside layers" in m for m in messages)


def test_dtype_names_are_torch_dtypes_of_the_right_size() -> None:
    for name in SAFETENSORS_DTYPES.values():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype)
        assert dtype.itemsize == DTYPE_ITEMSIZE[name], name


# ----------------------------------------------------------------------------- errors

def checkpoint_error(path: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    assert "\n" not in str(caught.value)
    return caught.value


def test_missing_path(tmp_path: Path) -> None:
    error = checkpoint_error(tmp_path / "nope")
    assert str(error) == f"{tmp_path / 'nope'}: no such file or directory"
    assert error.name == str(tmp_path / "nope")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    error = checkpoint_error(tmp_path)
    assert str(error) == f"{tmp_path}: no .safetensors files in this directory"


def test_a_file_that_is_not_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 100)
    error = checkpoint_error(tmp_path / "pytorch_model.bin")
    assert "not a .safetensors file, an index or a directory of them" in str(error)


def test_shorter_than_the_length_field(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").write_bytes(b"\x10\x00\x00")
    error = checkpoint_error(tmp_path)
    assert str(error) == f"{tmp_path / 'a.safetensors'}: truncated: the header length needs 8 bytes, found 3"
    assert error.name == str(tmp_path / "a.safetensors")


def test_header_length_larger_than_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", 500) + b'{"x": 1}')
    error = checkpoint_error(tmp_path)
    assert "truncated: header length 500 bytes but only 8 bytes follow the length field" in str(error)
    assert (error.name, error.value) == (str(path), 500)


def test_header_length_beyond_the_limit_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        file.truncate(MAX_HEADER_BYTES + 100)  # sparse: large enough that only the limit stops it
    error = checkpoint_error(tmp_path)
    assert f"header length {MAX_HEADER_BYTES + 1} bytes exceeds the {MAX_HEADER_BYTES}-byte limit" in str(error)
    assert MAX_HEADER_BYTES == 100 * 1024 * 1024


def test_file_cut_inside_the_data(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    write_safetensors(path, layer_tensors(0))
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 1)
    error = checkpoint_error(tmp_path)
    assert str(error).startswith(f"{path}: tensor 'model.layers.0.mlp.down_proj.weight': data_offsets")
    assert "end past the" in str(error) and "truncated or corrupt" in str(error)


def test_corrupt_header_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"{oops}")
    error = checkpoint_error(tmp_path)
    assert str(error).startswith(f"{path}: header is not valid JSON")


def test_unknown_dtype_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    raw = json.dumps({"layers.0.w": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(3))
    error = checkpoint_error(tmp_path)
    assert "tensor 'layers.0.w': unknown dtype 'F6_E2M3'" in str(error)
    assert error.value == "F6_E2M3"


def test_duplicate_tensor_across_shards_names_both_files(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", layer_tensors(0))
    write_safetensors(tmp_path / "b.safetensors", {**layer_tensors(1), "model.layers.0.input_layernorm.weight":
                                                   ("BF16", (64,))})
    error = checkpoint_error(tmp_path)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert str(error) == f"tensor 'model.layers.0.input_layernorm.weight' is in both {a} and {b}"
    assert (error.name, error.value) == ("model.layers.0.input_layernorm.weight", (str(a), str(b)))


def test_no_layers_in_the_checkpoint(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"embed.weight": ("F32", (4, 4))})
    error = checkpoint_error(tmp_path)
    assert "no layers found" in str(error) and "<stack>.<N>.<name>" in str(error)


def test_missing_layer_across_shards(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {**layer_tensors(0), **layer_tensors(1)})
    write_safetensors(tmp_path / "c.safetensors", layer_tensors(3))
    error = checkpoint_error(tmp_path)
    assert error.name == "model.layers.2"


def test_a_directory_that_cannot_be_read_as_a_file(tmp_path: Path) -> None:
    # A .safetensors path that is a directory with no shards: one line, no traceback-worthy error.
    folder = tmp_path / "x.safetensors"
    folder.mkdir()
    error = checkpoint_error(folder)
    assert str(error) == f"{folder}: no .safetensors files in this directory"


def test_headers_are_tensor_headers(two_shards: Path) -> None:
    parsed = read_safetensors_header(two_shards / "model-00002-of-00002.safetensors")
    assert all(isinstance(t, TensorHeader) for t in parsed)
    # Written last, after 64 + 4096 + 8192 (layer 2, FP8) + 256 (scale) + 128 (norm) bytes.
    assert parsed[0] == TensorHeader(name="lm_head.weight", dtype="float8_e4m3fn", shape=(100, 64),
                                     begin=12736, end=12736 + 6400)


def test_an_os_error_while_reading_is_one_line_naming_the_path(tmp_path: Path) -> None:
    # Opening a directory fails even for root, unlike a mode-0 file.
    folder = tmp_path / "x.safetensors"
    folder.mkdir()
    with pytest.raises(CheckpointError) as caught:
        read_safetensors_header(folder)
    assert str(caught.value) == f"{folder}: cannot read: Is a directory"
    assert isinstance(caught.value.__cause__, IsADirectoryError)
    assert caught.value.name == str(folder)


# ----------------------------------------------------------------------------- shards and the index

def test_a_symlinked_shard_is_read_through_its_link(tmp_path: Path) -> None:
    store = tmp_path / "blobs"
    store.mkdir()
    write_safetensors(store / "abc123", layer_tensors(0))
    folder = tmp_path / "snapshot"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(store / "abc123")
    assert [layer.name for layer in spec_from_checkpoint(folder).layers] == ["model.layers.0"]


@pytest.mark.parametrize("through", ["directory", "file"])
def test_a_dangling_shard_symlink_is_an_error_naming_it(tmp_path: Path, through: str) -> None:
    write_safetensors(tmp_path / "a.safetensors", layer_tensors(0))
    link = tmp_path / "b.safetensors"
    link.symlink_to(tmp_path / "gone")
    error = checkpoint_error(tmp_path if through == "directory" else link)
    assert str(error) == f"{link}: dangling symlink to {tmp_path / 'gone'}"
    assert error.name == str(link)


def test_a_shard_symlink_loop_is_an_error_naming_it(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", layer_tensors(0))
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "c.safetensors")
    (tmp_path / "c.safetensors").symlink_to(tmp_path / "b.safetensors")
    error = checkpoint_error(tmp_path)
    assert str(error) == f"{tmp_path / 'b.safetensors'}: symlink loop"


def test_a_shard_that_is_not_a_regular_file_is_an_error(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", layer_tensors(0))
    os.mkfifo(tmp_path / "b.safetensors")  # opening it would block forever
    error = checkpoint_error(tmp_path)
    assert str(error) == f"{tmp_path / 'b.safetensors'}: not a regular file"


def test_a_file_name_with_a_newline_stays_on_one_line(tmp_path: Path) -> None:
    link = tmp_path / "evil\nname.safetensors"
    link.symlink_to(tmp_path / "gone\x1b")
    error = checkpoint_error(tmp_path)
    assert str(error).startswith(repr(str(link)) + ": dangling symlink to ")
    assert "\x1b" not in str(error)
    assert error.name == str(link)


def test_the_index_decides_which_shards_are_read(two_shards: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A leftover file the index does not name (Mistral's repositories ship
    # consolidated.safetensors beside the sharded files) is not read, and a warning names it.
    (two_shards / "consolidated.safetensors").write_bytes(b"not even a header")
    assert checkpoint_files(two_shards) == (two_shards / "model-00001-of-00002.safetensors",
                                            two_shards / "model-00002-of-00002.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload.load"):
        result = read_checkpoint(two_shards)
    assert len(result.spec.layers) == 3
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "consolidated.safetensors" in warning.getMessage() and "not read" in warning.getMessage()


def test_the_index_can_be_given_as_the_path(two_shards: Path) -> None:
    index = two_shards / "model.safetensors.index.json"
    assert read_checkpoint(index) == read_checkpoint(two_shards)


def test_a_shard_the_index_names_must_exist(two_shards: Path) -> None:
    shard = two_shards / "model-00002-of-00002.safetensors"
    shard.unlink()
    error = checkpoint_error(two_shards)
    assert str(error) == (f"{two_shards / 'model.safetensors.index.json'}: names shard "
                          f"model-00002-of-00002.safetensors, which is not in {two_shards}")
    assert error.name == str(shard)


@pytest.mark.parametrize("kind", ["dangling", "loop", "directory"])
def test_a_broken_shard_the_index_names_is_an_error(two_shards: Path, kind: str) -> None:
    shard = two_shards / "model-00002-of-00002.safetensors"
    shard.unlink()
    if kind == "dangling":
        shard.symlink_to(two_shards / "gone")
    elif kind == "loop":
        shard.symlink_to(shard)
    else:
        shard.mkdir()
    error = checkpoint_error(two_shards)
    expected = {"dangling": f"dangling symlink to {two_shards / 'gone'}", "loop": "symlink loop",
                "directory": "not a regular file"}[kind]
    assert str(error) == f"{shard}: {expected}"


def test_a_tensor_in_another_shard_than_the_index_says(two_shards: Path) -> None:
    index = two_shards / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(document))
    error = checkpoint_error(two_shards)
    assert str(error) == (f"{index}: tensor 'model.norm.weight' is mapped to model-00001-of-00002.safetensors "
                          "but is in model-00002-of-00002.safetensors")
    assert error.name == "model.norm.weight"


def test_a_tensor_the_index_maps_but_no_shard_holds(two_shards: Path) -> None:
    index = two_shards / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["weight_map"]["model.layers.3.mlp.down_proj.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(document))
    error = checkpoint_error(two_shards)
    assert "tensor 'model.layers.3.mlp.down_proj.weight' is mapped to model-00002-of-00002.safetensors, " \
           "which does not hold it" in str(error)


@pytest.mark.parametrize(("text", "fragment"), [
    ("{}", "index has no 'weight_map' object"),
    ("not json", "index is not valid JSON"),
    ('{"weight_map": {"w": "../x.safetensors"}}', "is not a file name in the index's directory"),
])
def test_a_malformed_index_names_the_index(two_shards: Path, text: str, fragment: str) -> None:
    index = two_shards / "model.safetensors.index.json"
    index.write_text(text)
    error = checkpoint_error(two_shards)
    assert str(error).startswith(f"{index}: ")
    assert fragment in str(error)


def test_two_indexes_in_one_directory_must_be_chosen_between(two_shards: Path) -> None:
    write_index(two_shards, {"model-00001-of-00002.safetensors": layer_tensors(0)},
                name="model.fp16.safetensors.index.json")
    error = checkpoint_error(two_shards)
    assert "2 indexes" in str(error) and "model.fp16.safetensors.index.json" in str(error)
    assert "give the path of the one to read" in str(error)
