"""Placing host mappings on a NUMA node (offload.runtime.numa) and hostmem's use of it.

The placement is checked where the kernel reports it, /proc/self/numa_maps: the mapping's
policy and the node its pages landed on after they were touched.
"""

from __future__ import annotations

import errno
import logging
import mmap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from offload.pure.env.numa import NumaMapsEntry, parse_node_list, parse_numa_maps
from offload.runtime.hostmem import register_host_tensor
from offload.runtime.numa import MPOL_PREFERRED, HostPlacer, libc_mbind, node_mask
from tests.runtime.test_hostmem import FakeCudart

NUMA_MAPS = Path("/proc/self/numa_maps")


def numa_maps_entry(address: int) -> NumaMapsEntry | None:
    return parse_numa_maps(NUMA_MAPS.read_text(), address)


class FakeMbind:
    """Records mbind calls; answers each with the next errno of `answers` (0 = success)."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[int, int, int, tuple[int, ...], int, int]] = []

    def __call__(self, address: int, length: int, mode: int, mask: Sequence[int], maxnode: int, flags: int) -> int:
        self.calls.append((address, length, mode, tuple(mask), maxnode, flags))
        return self.answers.pop(0) if self.answers else 0


@pytest.mark.parametrize(("node", "words", "maxnode"), [(0, (1,), 65), (1, (2,), 65), (63, (1 << 63,), 65),
                                                       (64, (0, 1), 129), (130, (0, 0, 4), 193)])
def test_node_mask(node: int, words: tuple[int, ...], maxnode: int) -> None:
    assert node_mask(node) == (words, maxnode)


def test_registered_host_memory_is_placed_on_node_0_before_its_first_touch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not NUMA_MAPS.exists():
        pytest.skip("/proc/self/numa_maps is absent (a kernel without NUMA support)")
    caplog.set_level(logging.DEBUG, logger="offload.host")
    placer = HostPlacer(0)
    cudart = FakeCudart()  # registration is faked; the mapping and the mbind are real
    elements = 64 * mmap.PAGESIZE // 4
    held = register_host_tensor((elements,), (1,), torch.float32, register=cudart.register,
                                unregister=cudart.unregister, place=placer.place)
    address = held.tensor.data_ptr()
    assert address % mmap.PAGESIZE == 0 and cudart.registered[0][0] == address
    held.tensor.copy_(torch.arange(elements, dtype=torch.float32))  # the first touch
    entry = numa_maps_entry(address)
    assert entry is not None, f"no numa_maps line for {address:#x}"
    pages = held.reserved_bytes // mmap.PAGESIZE
    if placer.fallback_reason is None:
        # What the kernel says: the mapping prefers node 0, and all its pages are there.
        assert held.numa_placed and placer.placed == 1 and placer.fallbacks == 0
        assert entry.policy == "prefer:0", entry
        assert entry.pages == ((0, pages),), entry
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    else:
        # mbind is refused in this sandbox: the reason is logged once and the memory works.
        assert not held.numa_placed and placer.fallbacks == 1
        assert "mbind(MPOL_PREFERRED, node 0) failed" in placer.fallback_reason
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"host memory is not placed on NUMA node 0: {placer.fallback_reason}; host copies stay where the "
            "kernel puts them (host-to-device copies may be slower); not trying again"
        ]
        assert entry.policy == "default"
    assert torch.equal(held.tensor, torch.arange(elements, dtype=torch.float32))
    assert held.release() == []


def test_without_a_placer_the_mapping_keeps_the_default_policy() -> None:
    if not NUMA_MAPS.exists():
        pytest.skip("/proc/self/numa_maps is absent (a kernel without NUMA support)")
    cudart = FakeCudart()
    held = register_host_tensor((mmap.PAGESIZE,), (1,), torch.uint8, register=cudart.register,
                                unregister=cudart.unregister)
    held.tensor.fill_(1)
    entry = numa_maps_entry(held.tensor.data_ptr())
    assert entry is not None and entry.policy == "default"
    assert not held.numa_placed


def test_the_placer_calls_mbind_with_the_mapping_and_preferred_node() -> None:
    mbind = FakeMbind()
    placer = HostPlacer(1, mbind=mbind)
    cudart = FakeCudart()
    held = register_host_tensor((3 * mmap.PAGESIZE + 1,), (1,), torch.uint8, register=cudart.register,
                                unregister=cudart.unregister, place=placer.place)
    assert mbind.calls == [(held.tensor.data_ptr(), 4 * mmap.PAGESIZE, MPOL_PREFERRED, (2,), 65, 0)]
    assert held.numa_placed and placer.placed == 1


@pytest.mark.parametrize("code", [errno.EPERM, errno.ENOSYS])
def test_a_refused_mbind_is_logged_once_and_not_asked_again(code: int, caplog: pytest.LogCaptureFixture) -> None:
    mbind = FakeMbind(code)
    placer = HostPlacer(0, mbind=mbind)
    assert placer.place(0x1000, 4096) is False
    assert placer.place(0x2000, 4096) is False
    assert len(mbind.calls) == 1  # a permanent refusal: not asked again
    assert placer.fallbacks == 2 and placer.placed == 0
    assert placer.fallback_reason is not None and errno.errorcode[code] in placer.fallback_reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not trying again" in warnings[0]


def test_a_failed_mbind_that_may_pass_later_is_retried_but_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    mbind = FakeMbind(errno.ENOMEM, errno.ENOMEM, 0)
    placer = HostPlacer(0, mbind=mbind)
    assert [placer.place(0x1000 * i, 4096) for i in (1, 2, 3)] == [False, False, True]
    assert (placer.fallbacks, placer.placed, len(mbind.calls)) == (2, 1, 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ENOMEM" in warnings[0] and "not trying again" not in warnings[0]


def test_a_failed_placement_still_gives_working_registered_memory() -> None:
    placer = HostPlacer(0, mbind=FakeMbind(errno.EPERM))
    cudart = FakeCudart()
    held = register_host_tensor((100,), (1,), torch.int64, register=cudart.register, unregister=cudart.unregister,
                                place=placer.place)
    held.tensor.copy_(torch.arange(100))
    assert torch.equal(held.tensor, torch.arange(100)) and not held.numa_placed
    assert len(cudart.registered) == 1


def test_an_unknown_architecture_has_no_mbind() -> None:
    with pytest.raises(OSError, match="no mbind system call number known for 'vax'"):
        libc_mbind("vax")


def test_a_placer_without_mbind_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    placer = HostPlacer(0, machine="vax")
    assert placer.place(0x1000, 4096) is False
    assert placer.place(0x2000, 4096) is False
    assert placer.fallback_reason == "no mbind system call number known for 'vax'"
    assert placer.fallbacks == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not trying again" in warnings[0]


@pytest.mark.parametrize("node", [-1, True, 1.0, "0"])
def test_a_placer_needs_a_node_number(node: object) -> None:
    with pytest.raises(ValueError, match="NUMA node number"):
        HostPlacer(node)  # type: ignore[arg-type]  # the mistake under test


def test_a_node_this_host_lacks_is_refused_by_the_kernel_and_the_memory_still_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    online = Path("/sys/devices/system/node/online")
    if not online.exists():
        pytest.skip("no /sys/devices/system/node/online to pick an absent node from")
    absent = max(parse_node_list(online.read_text()), default=0) + 1
    placer = HostPlacer(absent)
    cudart = FakeCudart()
    held = register_host_tensor((8 * mmap.PAGESIZE,), (1,), torch.uint8, register=cudart.register,
                                unregister=cudart.unregister, place=placer.place)
    held.tensor.fill_(3)
    assert int(held.tensor.sum()) == 3 * 8 * mmap.PAGESIZE
    assert not held.numa_placed and placer.fallbacks == 1
    assert placer.fallback_reason is not None and f"node {absent}) failed" in placer.fallback_reason
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
