"""The real cudaDevAttrHostRegisterReadOnlySupported query on a CUDA device:
the device answers 0 or 1, and the answer holds: a follower's ``PROT_READ`` mapping of
a shared segment registers with the follower's flags exactly when it says 1, and where
it says 0 a follower's `SharedHostSource` does not try.

Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import mmap
import os

import attrs
import pytest
import torch

from offload.pure.decide.pinning import PinMethod
from offload.pure.sharing.plan import SegmentLayout, Slot
from offload.runtime.hostmem import HostRegisterError
from offload.sharing.pinning import HOST_REGISTER_FOLLOWER, cuda_pin_calls, register_range, unregister_pieces
from offload.sharing.segment import create_segment, open_segment, reserve_segment, unlink_segment
from offload.sharing.source import SharedHostSource

DEVICE = torch.device("cuda", 0)
PAGES = 4


def test_the_device_says_whether_it_takes_read_only_registrations_and_that_holds() -> None:
    calls = cuda_pin_calls(DEVICE)
    answer = calls.read_only_supported()
    assert answer in (0, 1), answer  # read, not unknown: libcudart is the one torch loaded
    nbytes = PAGES * mmap.PAGESIZE
    leader, fd = create_segment(nbytes)
    try:
        reserve_segment(fd, nbytes)
        follower = open_segment(leader.name, nbytes)
    finally:
        os.close(fd)
        unlink_segment(leader.name)
    leader.view(0, nbytes, (nbytes,), (1,), torch.uint8).fill_(7)
    if answer:
        pieces = register_range(calls, follower.base, nbytes, HOST_REGISTER_FOLLOWER)
        assert pieces == ((follower.base, nbytes),)
        assert unregister_pieces(calls, pieces) == []
    else:
        with pytest.raises(HostRegisterError):
            register_range(calls, follower.base, nbytes, HOST_REGISTER_FOLLOWER)
    # A follower's source asks the same and registers only where the answer is 1.
    asked: list[int] = []
    registered: list[int] = []

    def register(pointer: int, size: int, flags: int) -> int:
        registered.append(pointer)
        return calls.register(pointer, size, flags)

    def read_only_supported() -> int | None:
        value = calls.read_only_supported()
        asked.append(value if value is not None else -1)
        return value

    recording = attrs.evolve(calls, register=register, read_only_supported=read_only_supported)
    layout = SegmentLayout(slots=(Slot(ref=(0, "w"), offset=0, nbytes=nbytes, shape=(nbytes,), stride=(1,),
                                       dtype="uint8"),), align=mmap.PAGESIZE, total_bytes=nbytes)
    source = SharedHostSource(layout, leader=False, rank=1, leader_rank=0, pin=PinMethod.REGISTER, device=DEVICE,
                              pin_calls=recording)
    source.attach(follower)
    source.allow([(0, "w")])
    view = source.slot_view((0, "w"))
    assert view is not None and bool((view == 7).all())
    assert asked == [answer]
    assert registered == ([follower.base] if answer else [])
    assert source.fallbacks == (0 if answer else 1)
    assert view.is_pinned() is bool(answer)
    source.close()
