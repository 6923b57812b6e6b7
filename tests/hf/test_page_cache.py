"""What loading a checkpoint leaves in the page cache: nothing. A streamed load
(`offload_pretrained(..., host_budget_bytes=)`) and greedy ``generate`` with its disk tier
read every tensor with ``O_DIRECT`` (the loader's resident, host-tier and outside weights,
and the tier's disk layers), and the safetensors headers are read without readahead and
dropped; where a filesystem refuses ``O_DIRECT`` the reader reads buffered without
readahead and drops the pages it read. Each checkpoint file is checked page by page with
``mincore`` (`cached_pages`) after its pages were evicted; on a filesystem that keeps its
files in memory (tmpfs) there is nothing to measure and the tests skip."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from offload import EnvSnapshot, OffloadConfig
from offload.hf import load_on_host, offload_pretrained
from offload.model.checkpoint import checkpoint_extents
from offload.runtime.cpu import CpuRuntime
from offload.runtime.diskio import BLOCK_BYTES, DiskReader
from offload.runtime.diskrate import evict
from tests.executors.disk_helpers import plan_tier
from tests.hf.checkpoints import build, save, step_logits

#: Three of four layers offloaded, one staging buffer: two layers go to disk.
FOUR = OffloadConfig(group_size=4, num_in_group=3)


def cached_pages(path: Path) -> int:
    """How many pages of `path` are in the page cache (``mincore`` of a private mapping:
    asking faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as region:
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        return sum(v & 1 for v in vector)


def _evict(files: list[Path]) -> None:
    """Write the files back and drop their pages; skip where they stay (tmpfs)."""
    evict(files)
    kept = {path.name: cached_pages(path) for path in files if cached_pages(path)}
    if kept:
        pytest.skip(f"the filesystem of {files[0].parent} keeps its files in memory (pages left: {kept})")


def _cached(files: list[Path]) -> dict[str, int]:
    """Each file with pages in the page cache, and how many."""
    return {path.name: n for path in files if (n := cached_pages(path))}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save(build("llama"), tmp_path / "ckpt", sharded=True)


def _files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    assert len(files) > 2
    return files


def test_reading_the_headers_leaves_no_page_cached(checkpoint: Path) -> None:
    files = _files(checkpoint)
    _evict(files)
    found = checkpoint_extents(checkpoint)
    assert len(found.files) == len(files) and found.tensors
    assert _cached(files) == {}


def test_a_streamed_load_and_generate_leave_no_page_cached(checkpoint: Path) -> None:
    files = _files(checkpoint)
    reference = load_on_host(checkpoint)
    want = step_logits(reference)
    budget = plan_tier(reference, checkpoint, read_ahead=1, config=FOUR)[0].host_bytes - 1
    del reference
    _evict(files)
    model, offloader = offload_pretrained(checkpoint, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, read_ahead=1)
    tier = offloader.disk_tier
    assert tier is not None and tier.disk_layers and tier.host_tier_bytes  # disk, host and resident layers
    assert offloader.plan.device_bytes_resident > 0
    assert _cached(files) == {}
    got = step_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert offloader.stats().disk_bytes_read >= tier.disk_bytes  # the disk layers were read again
    assert _cached(files) == {}


def test_the_readers_buffered_reads_leave_no_page_cached(tmp_path: Path) -> None:
    """Where a filesystem refuses ``O_DIRECT`` (here: asked to read buffered): one run of
    requests, as the ring reads a layer; no readahead past what was asked, and the pages
    read dropped."""
    path = tmp_path / "data"
    data = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    _evict([path])
    offset, length = BLOCK_BYTES + 100, 4 << 20
    with DiskReader(direct=False, threads=1) as reader:
        for k in range(4):
            dest = torch.empty(length, dtype=torch.uint8)
            assert reader.submit(path, offset + k * length, length, dest).wait() == length
            assert torch.equal(dest, data[offset + k * length:offset + (k + 1) * length])
    assert _cached([path]) == {}


def test_offload_model_of_a_loaded_model_with_its_checkpoint_leaves_no_page_cached(checkpoint: Path,
                                                                                  tmp_path: Path) -> None:
    # The disk tier checks each disk weight against the checkpoint byte for byte (a read of
    # its bytes) before it maps it there: those reads are let go of, whole pages.
    from offload.hf import offload_model

    files = _files(checkpoint)
    model = build("llama")  # the checkpoint's model, in memory of its own (from_pretrained would map the files)
    expected = step_logits(model)
    _evict(files)
    budget = plan_tier(model, None, read_ahead=1, config=FOUR)[0].host_bytes // 2
    offloader = offload_model(model, FOUR, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=budget,
                              checkpoint=checkpoint, spill_dir=tmp_path, read_ahead=1)
    tier = offloader.disk_tier
    assert tier is not None and tier.disk_bytes - tier.spill_bytes > 0  # some read where they lie
    assert _cached(files) == {}
    assert [torch.equal(a, b) for a, b in zip(step_logits(model), expected, strict=True)] == [True] * len(expected)
    assert _cached(files) == {}
    offloader.restore()
