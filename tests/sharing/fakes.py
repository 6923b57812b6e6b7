"""Fake CUDA registration calls for the sharing tests (a fake, not a mock: it records),
and a segment mapped twice in this process (a leader's and a follower's mapping)."""

from __future__ import annotations

import os

import attrs

from offload.pure.sharing.plan import SegmentLayout
from offload.sharing.pinning import PinCalls
from offload.sharing.segment import SegmentMapping, create_segment, open_segment, unlink_segment

__all__ = ["FakePins", "mapped_twice"]


def mapped_twice(layout: SegmentLayout) -> tuple[SegmentMapping, SegmentMapping]:
    """A new segment for `layout`, mapped read-write (the leader's) and read-only (a
    follower's); its name is already unlinked, so nothing is left behind."""
    leader, fd = create_segment(layout.total_bytes)
    try:
        follower = open_segment(leader.name, layout.total_bytes)
    finally:
        os.close(fd)
        unlink_segment(leader.name)
    return leader, follower


@attrs.define
class FakePins:
    """Records registrations; fails the ones whose index is in `fail`."""

    fail: set[int] = attrs.Factory(set)
    registered: list[tuple[int, int, int]] = attrs.Factory(list)
    unregistered: list[int] = attrs.Factory(list)

    def calls(self) -> PinCalls:
        def register(pointer: int, nbytes: int, flags: int) -> int:
            index = len(self.registered)
            self.registered.append((pointer, nbytes, flags))
            return 1 if index in self.fail else 0

        def unregister(pointer: int) -> int:
            self.unregistered.append(pointer)
            return 0

        return PinCalls(register=register, unregister=unregister)
