"""Where a checkpoint's tensors lie on disk (`checkpoint_extents`, `offload.pure.spec.extents`):
every tensor's bytes read at its extent are the bytes safetensors loads, in a sharded and
a single-file checkpoint; the aligned span an ``O_DIRECT`` read asks for holds the extent
and is the smallest that does; a parameter is mappable exactly when its bytes in the file
are its bytes in memory; a file's identity tells an unchanged file from a touched or a
replaced one; the disk reader reads every extent bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from offload import CheckpointError
from offload.model.checkpoint import changed_files, checkpoint_extents, checkpoint_files, file_identity
from offload.pure.spec.extents import DiskExtent, unmappable
from offload.pure.spec.safetensors import TensorHeader
from offload.pure.spec.values import ParamSpec
from offload.runtime.diskio import DiskReader
from tests.hf.checkpoints import build, save


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one-file"])
def test_every_tensor_read_at_its_extent_is_what_safetensors_loads(tmp_path: Path, sharded: bool) -> None:
    path = save(build("llama"), tmp_path, sharded=sharded)
    found = checkpoint_extents(path)
    files = checkpoint_files(path)
    assert len(files) > 1 if sharded else len(files) == 1
    assert sorted(identity.path for identity in found.files) == sorted(os.fspath(f) for f in files)
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        loaded.update(load_file(os.fspath(file)))
    assert sorted(found.extents) == sorted(loaded)
    for name, extent in found.extents.items():
        with open(extent.path, "rb") as handle:
            handle.seek(extent.offset)
            raw = handle.read(extent.length)
        want = loaded[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert raw == want, name
        assert extent.length == found.tensors[name].nbytes


@given(offset=st.integers(0, 1 << 40), length=st.integers(0, 1 << 30),
       block=st.sampled_from([512, 4096, 1 << 20]))
def test_the_aligned_span_is_the_smallest_span_of_whole_blocks_holding_the_extent(offset: int, length: int,
                                                                                   block: int) -> None:
    extent = DiskExtent(path="f", offset=offset, length=length)
    first, span = extent.aligned(block)
    assert first % block == 0 and span % block == 0
    assert first <= offset and first + span >= offset + length
    assert first + block > offset  # starts in the block holding the first byte
    assert first + span - block < max(offset + length, first + 1)  # a block less would not hold the last byte


@pytest.mark.parametrize("block", [0, -4096, 3000])
def test_a_block_size_that_is_not_a_power_of_two_is_refused(block: int) -> None:
    with pytest.raises(CheckpointError, match=f"block size {block} is not a positive power of two"):
        DiskExtent(path="f", offset=0, length=1).aligned(block)


def _param(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str = "bfloat16") -> ParamSpec:
    return ParamSpec(name="w", shape=shape, stride=stride, dtype=dtype, itemsize=2 if dtype != "float32" else 4)


_HEADER = TensorHeader(name="model.layers.0.w", dtype="bfloat16", shape=(4, 8), begin=0, end=64)


@pytest.mark.parametrize(("param", "reason"), [
    (_param((4, 8), (8, 1)), None),
    (_param((4, 8), (8, 1), "float16"), "dtype bfloat16 in the checkpoint, float16 in the model"),
    (_param((8, 4), (4, 1)), "shape [4, 8] in the checkpoint, [8, 4] in the model"),
    (_param((4, 8), (1, 4)), "strides [1, 4] in the model, not contiguous"),
], ids=["same", "dtype", "shape", "transposed"])
def test_a_parameter_is_mappable_exactly_when_its_bytes_are_the_files(param: ParamSpec, reason: str | None) -> None:
    assert unmappable(param, _HEADER) == reason


def test_strides_of_dimensions_of_size_one_do_not_matter() -> None:
    header = TensorHeader(name="b", dtype="bfloat16", shape=(1, 8), begin=0, end=16)
    assert unmappable(_param((1, 8), (99, 1)), header) is None


def test_a_files_identity_tells_a_touched_or_replaced_file_from_an_unchanged_one(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x" * 100)
    planned = file_identity(file)
    assert planned.changes(file_identity(file)) == ()
    os.utime(file, ns=(planned.mtime_ns, planned.mtime_ns + 10**9))
    assert planned.changes(file_identity(file)) == ("mtime_ns",)
    other = tmp_path / "other"
    other.write_bytes(b"y" * 101)
    os.replace(other, file)
    assert {"size", "inode"} <= set(planned.changes(file_identity(file)))
    file.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        file_identity(file)


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "buffered"])
def test_the_disk_reader_reads_every_extent_bit_for_bit(tmp_path: Path, direct: bool) -> None:
    """The disk tier's two halves together: each tensor's extent, read by the reader into
    a host buffer (the tensor's own offset rarely on a block boundary), is its bytes."""
    path = save(build("llama"), tmp_path, sharded=True)
    found = checkpoint_extents(path)
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        loaded.update(load_file(os.fspath(file)))
    assert any(extent.offset % 4096 for extent in found.extents.values())  # the premise: unaligned starts
    with DiskReader(threads=2, chunk_bytes=1 << 16, direct=direct) as reader:
        buffers = {name: torch.empty(extent.length, dtype=torch.uint8) for name, extent in found.extents.items()}
        handles = [reader.submit(extent.path, extent.offset, extent.length, buffers[name])
                   for name, extent in found.extents.items()]
        assert sum(handle.wait() for handle in handles) == sum(e.length for e in found.extents.values())
    for name, tensor in loaded.items():
        assert torch.equal(buffers[name].view(tensor.dtype).view(tensor.shape), tensor), name


def test_changed_files_names_each_file_not_as_planned_and_how(tmp_path: Path) -> None:
    path = save(build("llama"), tmp_path, sharded=True)
    planned = checkpoint_extents(path).files
    assert changed_files(planned) == ()
    touched, gone = planned[0].path, planned[1].path
    os.utime(touched, ns=(planned[0].mtime_ns, planned[0].mtime_ns + 1))
    os.unlink(gone)
    assert changed_files(planned) == ((touched, ("mtime_ns",)), (gone, ("missing",)))
