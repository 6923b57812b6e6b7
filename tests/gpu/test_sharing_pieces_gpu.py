"""Shared host copies registered in several pieces on a real CUDA device: the
source tells the runtime, which cuts each copy at the pieces' ends, so copies stay
asynchronous and capturable; outputs bit for bit. One process: the leader's view alone."""

from __future__ import annotations

import copy
import mmap
import os

import pytest
import torch

from offload import OffloadConfig
from offload.executors.prefetch import PrefetchOffloader
from offload.protocols import RegisteredRanges
from offload.pure import PinMethod
from offload.pure.sharing.plan import lay_out
from offload.runtime.cuda import CudaRuntime
from offload.sharing.segment import create_segment, reserve_segment, shm_free_bytes, unlink_segment
from offload.sharing.source import SharedHostSource
from tests.executors.models import layer_list
from tests.gpu.test_prefetch_gpu import gpu_inputs, gpu_model, plan_for


def test_slots_registered_in_pieces_are_cut_by_the_runtime_and_bit_exact() -> None:
    model = gpu_model(3)
    reference = copy.deepcopy(model)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2))
    assert plan.pin.method is PinMethod.REGISTER
    runtime = CudaRuntime()
    assert isinstance(runtime, RegisteredRanges)
    layout = lay_out(plan, mmap.PAGESIZE)
    free = shm_free_bytes()
    if free is not None and free < layout.total_bytes:
        pytest.skip(f"/dev/shm has {free} bytes free, the segment needs {layout.total_bytes}")
    mapping, fd = create_segment(layout.total_bytes)
    try:
        reserve_segment(fd, layout.total_bytes)  # a short /dev/shm fails here, not with SIGBUS on a write
    finally:
        os.close(fd)
        unlink_segment(mapping.name)
    source = SharedHostSource(layout, leader=True, rank=0, leader_rank=0, pin=plan.pin.method, device=runtime.device,
                              piece_bytes=1 << 20, ranges=runtime)
    source.attach(mapping)
    off = PrefetchOffloader(plan, runtime, host_source=source)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert runtime._range_starts  # the 8 MiB slots were registered in pieces, and the runtime knows them
    assert source.fallbacks == 0
    for x in gpu_inputs(seed=5, count=3):
        assert torch.equal(model(x), reference(x))
    off.restore()
    source.close()
    assert not runtime._range_starts
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)
