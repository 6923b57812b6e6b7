"""Every sharing test leaves no segment of ours in /dev/shm."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from offload.sharing import leftover_segments


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    before = set(leftover_segments())
    yield
    left = set(leftover_segments()) - before
    assert left == set(), f"segments left in /dev/shm: {sorted(left)}"
