"""`benchmarks.copies_off.CopiesOff`: copies pass through until switched off, then are
only events; a runtime without host blocks or prepared copies is refused."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from benchmarks.copies_off import CopiesOff
from offload import ExecutionError
from offload.protocols import HostBlocks, PreparedCopies
from offload.runtime.cpu import CpuRuntime
from tests.executors.blocks_helpers import BlockRuntime


def test_copies_pass_through_until_switched_off_then_only_events_are_made() -> None:
    inner = CpuRuntime()
    rt = CopiesOff(inner)
    # What the executor checks before it takes the block and prepared-copy paths.
    assert isinstance(cast(object, rt), HostBlocks) and isinstance(cast(object, rt), PreparedCopies)
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(64)
    rt.copy_chunks_after(rt.copy_chunks(dst, src), rt.record())
    assert torch.equal(dst, src)
    copied = inner.copy_seconds()
    rt.switch_off()
    src.add_(1.0)
    chunks = rt.copy_chunks(dst, src)
    rt.copy_chunks_after(chunks, rt.record())
    rt.copy_after(dst, src, None)
    assert torch.equal(dst, src - 1.0)  # nothing was copied
    assert inner.copy_seconds() == copied  # and the inner runtime timed no copy


def test_a_runtime_without_prepared_copies_is_refused() -> None:
    with pytest.raises(ExecutionError, match="BlockRuntime offers no host blocks or no prepared copies"):
        CopiesOff(BlockRuntime())
