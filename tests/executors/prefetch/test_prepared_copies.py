"""Copies prepared once: a runtime with `PreparedCopies` is asked at post_init
how each copy is cut (`copy_chunks`), and every step after that issues the prepared
chunks (`copy_chunks_after`) without working them out again. A runtime without it (the
wrappers in the tests that do not pass it on) gets `copy_after` as before."""

from __future__ import annotations

import copy
import gc
from typing import cast

import attrs
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload import OffloadConfig
from offload.protocols import PreparedCopies
from offload.pure import LayerBlocks
from offload.runtime.copies import byte_span, span_chunks
from offload.runtime.cpu import CpuEvent, CpuRuntime
from tests.executors.blocks_helpers import BlockRuntime, linear_stack
from tests.executors.fakes import Copy
from tests.executors.helpers import assert_restored, cpu_plan, prefetch, snapshot
from tests.executors.models import layer_list
from tests.executors.prefetch.test_layer_blocks import activations


@attrs.define
class Counts:
    prepared: list[tuple[int, int]] = attrs.field(factory=list)  # (destination, source) data pointers
    destinations: list[StorageWeakRef] = attrs.field(factory=list)  # the storages the prepared chunks write
    chunk_copies: int = 0
    plain_copies: int = 0


def counting(rt: CpuRuntime, monkeypatch: pytest.MonkeyPatch) -> Counts:
    """Count how `rt`'s copies are asked for (prepared, issued prepared, issued plainly)."""
    counts = Counts()
    copy_chunks, copy_chunks_after, copy_after = rt.copy_chunks, rt.copy_chunks_after, rt.copy_after

    def chunks(dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        counts.prepared.append((dst.data_ptr(), src.data_ptr()))
        chunks = copy_chunks(dst, src)
        counts.destinations += [StorageWeakRef(d.untyped_storage()) for d, _ in chunks]  # type: ignore[no-untyped-call]  # unannotated in torch
        return chunks

    def chunks_after(chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: object) -> CpuEvent:
        counts.chunk_copies += 1
        return copy_chunks_after(chunks, after)

    def plain(dst: torch.Tensor, src: torch.Tensor, after: object) -> CpuEvent:
        counts.plain_copies += 1
        return copy_after(dst, src, after)

    monkeypatch.setattr(rt, "copy_chunks", chunks)
    monkeypatch.setattr(rt, "copy_chunks_after", chunks_after)
    monkeypatch.setattr(rt, "copy_after", plain)
    return counts


@pytest.mark.parametrize(("blocks", "per_layer"), [("always", 1), ("never", 2)])
def test_each_copy_is_prepared_once_at_post_init_and_reused_every_step(
        blocks: LayerBlocks, per_layer: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = linear_stack(5)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    rt = CpuRuntime()
    counts = counting(rt, monkeypatch)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2, layer_blocks=blocks)), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert len(counts.prepared) == 5 * per_layer
    assert len(set(counts.prepared)) == len(counts.prepared)  # each copy once
    initial = counts.chunk_copies
    assert initial == 2 * per_layer  # the first two layers' copies, issued by post_init
    forwards = 0
    with torch.inference_mode():
        for x in activations():
            assert torch.equal(model(x), reference(x))
            forwards += 1
    assert len(counts.prepared) == 5 * per_layer  # nothing worked out again
    assert counts.plain_copies == 0
    assert counts.chunk_copies == initial + forwards * 5 * per_layer == off.stats().copies_issued
    off.restore()
    assert_restored(model, before, same_storage=False)
    gc.collect()
    assert all(ref.expired() for ref in counts.destinations)  # type: ignore[no-untyped-call]  # as above


def test_a_runtime_without_prepared_copies_gets_copy_after() -> None:
    model = linear_stack(3)
    reference = copy.deepcopy(model)
    rt = BlockRuntime()  # a wrapper offering HostBlocks, not PreparedCopies
    assert not isinstance(cast(object, rt), PreparedCopies) and isinstance(rt.inner, PreparedCopies)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=1, layer_blocks="never")), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert len(rt.copies) == 2  # copy_after: the first layer's two parameters, issued by post_init
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    assert len(rt.copies) - 2 == 4 * 3 * 2  # forwards x layers x parameters
    assert sum(isinstance(entry, Copy) for entry in rt.inner.log) == len(rt.copies)
    off.restore()


def test_cpu_runtime_chunks_are_span_chunks_and_copy_the_span() -> None:
    runtime = CpuRuntime()
    assert isinstance(runtime, PreparedCopies)
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    src = base[:, :5]  # not dense: gaps of 3 elements between rows
    dst = torch.full_like(base, -1.0)[:, :5]
    chunks = runtime.copy_chunks(dst, src)
    expected = span_chunks(dst, src)
    assert [(d.data_ptr(), d.numel(), s.data_ptr(), s.numel()) for d, s in chunks] == \
        [(d.data_ptr(), d.numel(), s.data_ptr(), s.numel()) for d, s in expected]
    runtime.copy_chunks_after(chunks, runtime.record())
    assert torch.equal(dst, src)
    assert torch.equal(byte_span(dst), byte_span(src))  # the gap bytes came too
    assert runtime.copy_seconds() > 0.0
