"""Segments in /dev/shm: made sparse, mapped read-write by the leader and read-only by the
others, named only until unlinked, released with the last tensor over them."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from offload import ExecutionError
from offload.capture.smaps import segment_memory
from offload.sharing.segment import (
    SEGMENT_PREFIX,
    SHM_DIR,
    check_room,
    create_segment,
    leftover_segments,
    open_segment,
    reserve_segment,
    shm_identity,
    unlink_segment,
)

SIZE = 1 << 16


def test_the_leader_writes_followers_read_the_same_bytes_and_cannot_write() -> None:
    leader, fd = create_segment(SIZE)
    try:
        assert leader.name.startswith(SEGMENT_PREFIX) and leader.name in leftover_segments()
        follower = open_segment(leader.name, SIZE)
        assert unlink_segment(leader.name) and leader.name not in leftover_segments()
        reserve_segment(fd, SIZE)
    finally:
        os.close(fd)
    written = leader.view(4096, 64, (4, 4), (1, 4), torch.float32)  # a transposed view
    written.copy_(torch.arange(16, dtype=torch.float32).reshape(4, 4))
    read = follower.view(4096, 64, (4, 4), (1, 4), torch.float32)
    assert torch.equal(read, written) and read.data_ptr() != written.data_ptr()
    assert read.untyped_storage().nbytes() == 64  # its own storage of exactly the slot
    assert follower.contains(read) and not follower.contains(written) and leader.contains(written)
    assert not follower.contains(torch.zeros(3))
    with open("/proc/self/maps") as f:
        perms = {line.split()[1] for line in f if leader.name in line}
    assert perms == {"rw-s", "r--s"}  # the kernel refuses a follower's write


def test_tensors_keep_the_mapping_until_the_last_one_dies() -> None:
    mapping, fd = create_segment(SIZE)
    os.close(fd)
    unlink_segment(mapping.name)
    name = mapping.name
    view = mapping.view(0, 16, (4,), (1,), torch.float32)
    mapping.drop()
    del mapping
    gc.collect()
    assert segment_memory(name).mappings == 1  # the tensor holds it
    view.fill_(1.0)  # still valid memory
    del view
    gc.collect()
    assert segment_memory(name).mappings == 0


def test_views_outside_the_segment_or_after_drop_are_refused() -> None:
    mapping, fd = create_segment(SIZE)
    os.close(fd)
    unlink_segment(mapping.name)
    with pytest.raises(ExecutionError, match="outside segment"):
        mapping.view(SIZE - 8, 16, (4,), (1,), torch.float32)
    mapping.drop()
    with pytest.raises(ExecutionError, match="no longer held"):
        mapping.view(0, 16, (4,), (1,), torch.float32)


def test_a_missing_or_resized_segment_is_refused_by_name() -> None:
    with pytest.raises(ExecutionError, match="cannot open the shared host copy .*one IPC namespace"):
        open_segment(f"{SEGMENT_PREFIX}missing", SIZE)
    mapping, fd = create_segment(SIZE)
    os.close(fd)
    try:
        with pytest.raises(ExecutionError, match=f"has {SIZE} bytes, the layout {2 * SIZE}"):
            open_segment(mapping.name, 2 * SIZE)
    finally:
        unlink_segment(mapping.name)
    assert not unlink_segment(mapping.name)  # already gone


def test_too_little_shared_memory_is_refused_before_anything_is_made() -> None:
    with pytest.raises(ExecutionError, match=r"needs 2.00 GiB in /dev/shm, which has 64.0 MiB free .*--shm-size") as e:
        check_room(2 << 30, 64 << 20)
    assert e.value.name == "shm_free" and e.value.value == (2 << 30, 64 << 20)
    check_room(1, None)  # unknown room: allowed
    check_room(10, 10)


def test_reserving_more_than_the_file_system_holds_is_an_error_not_a_sigbus() -> None:
    mapping, fd = create_segment(SIZE)
    try:
        unlink_segment(mapping.name)
        with pytest.raises(ExecutionError, match="cannot reserve"):
            reserve_segment(fd, 1 << 62)
    finally:
        os.close(fd)


def test_the_shared_memory_file_system_has_an_identity() -> None:
    assert shm_identity() == str(os.stat(SHM_DIR).st_dev)
    assert shm_identity("/no/such/dir") == "none"
