"""The cgroup memory limit: the text parsers (`offload.pure.env.procfs`), the path and
binding steps and the value (`offload.pure.env.cgroup`), on sample texts."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from offload.errors import PlanError
from offload.pure import EnvSnapshot, Platform
from offload.pure.env.cgroup import (
    CgroupLevel,
    CgroupMemory,
    binding_cgroup,
    cgroup_dirs,
    choose_mount,
)
from offload.pure.env.procfs import (
    parse_cgroup_bytes,
    parse_cgroup_limit,
    parse_cgroup_mounts,
    parse_cgroup_reclaimable,
    parse_proc_cgroup,
)

GiB = 1 << 30

# ---------------------------------------------------------------- /proc/self/cgroup

# This CPU machine (FACTS.md): hybrid, the memory controller on v1, v2 mounted without it.
HYBRID = """\
9:name=systemd:/
8:pids:/
5:devices:/
4:memory:/process_api/8b26ab84c07de0b5609eae70b61b3a35
3:cpuset:/
0::/
"""
PURE_V2 = "0::/user.slice/user-1000.slice/session-3.scope\n"
DOCKER_V1 = "12:hugetlb:/docker/abc\n11:memory,hugetlb:/docker/abc\n1:name=systemd:/docker/abc\n"
K8S_V2_NESTED = "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-2.scope\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(HYBRID, ("/", "/process_api/8b26ab84c07de0b5609eae70b61b3a35"), id="hybrid"),
        pytest.param(PURE_V2, ("/user.slice/user-1000.slice/session-3.scope", None), id="v2"),
        pytest.param(K8S_V2_NESTED, (K8S_V2_NESTED.strip()[3:], None), id="v2-nested"),
        pytest.param(DOCKER_V1, (None, "/docker/abc"), id="v1-comma-controllers"),
        pytest.param("0::/\n", ("/", None), id="v2-namespace-root"),
        pytest.param("", (None, None), id="empty"),
        pytest.param("garbage\n4:memory\n4:memory:relative\n0:x:/a\n", (None, None), id="junk"),
        pytest.param("4:memory:/a:b\n", (None, "/a:b"), id="colon-in-path"),
        pytest.param("4:memory:/first\n5:memory:/second\n0::/a\n0::/b\n", ("/a", "/first"), id="first-wins"),
        pytest.param("4:memoryx:/a\n4:xmemory:/b\n", (None, None), id="whole-controller-names"),
    ],
)
def test_parse_proc_cgroup(text: str, expected: tuple[str | None, str | None]) -> None:
    assert parse_proc_cgroup(text) == expected


# ---------------------------------------------------------------- /proc/self/mountinfo

MOUNTINFO_HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
MOUNTINFO_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTINFO_DOCKER_V1 = (
    "720 711 0:31 /docker/abc /sys/fs/cgroup/memory ro,nosuid master:15 - cgroup cgroup rw,memory,hugetlb\n"
)
MOUNTINFO_SPACES = "40 31 0:38 / /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(MOUNTINFO_HYBRID, ((1, "/", "/sys/fs/cgroup/memory"), (2, "/", "/sys/fs/cgroup/unified")),
                     id="hybrid"),
        pytest.param(MOUNTINFO_V2, ((2, "/", "/sys/fs/cgroup"),), id="v2-optional-fields"),
        pytest.param(MOUNTINFO_DOCKER_V1, ((1, "/docker/abc", "/sys/fs/cgroup/memory"),), id="v1-subtree-root"),
        pytest.param(MOUNTINFO_SPACES, ((2, "/", "/mnt/my cgroups"),), id="octal-escape"),
        pytest.param("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", (), id="v1-without-memory"),
        pytest.param("", (), id="empty"),
        pytest.param("no separator here\n1 2 - cgroup2\n", (), id="junk"),
    ],
)
def test_parse_cgroup_mounts(text: str, expected: tuple[tuple[int, str, str], ...]) -> None:
    assert parse_cgroup_mounts(text) == expected


# ---------------------------------------------------------------- limit, usage, stat files


@pytest.mark.parametrize(
    ("text", "version", "expected"),
    [
        pytest.param("max\n", 2, None, id="v2-max"),
        pytest.param("68719476736\n", 2, 64 * GiB, id="v2-64GiB"),
        pytest.param("0\n", 2, 0, id="v2-zero"),
        pytest.param("9223372036854771712\n", 1, None, id="v1-unlimited-4k-pages"),
        pytest.param("9223372036854710272\n", 1, None, id="v1-unlimited-64k-pages"),
        pytest.param(str(1 << 62), 1, None, id="v1-2**62-is-unlimited"),
        pytest.param(str((1 << 62) - 4096), 1, (1 << 62) - 4096, id="v1-just-below-2**62"),
        pytest.param("-1\n", 1, None, id="v1-minus-one"),
        pytest.param("  17179869184  \n", 1, 16 * GiB, id="v1-16GiB-spaces"),
    ],
)
def test_parse_cgroup_limit(text: str, version: int, expected: int | None) -> None:
    assert parse_cgroup_limit(text, version) == expected


@pytest.mark.parametrize(
    ("text", "version"),
    [("", 2), ("lots\n", 2), ("max\n", 1), ("12 34\n", 2), ("1.5e9\n", 1), ("\u0661\n", 2)],
)
def test_parse_cgroup_limit_refuses_what_is_not_a_limit(text: str, version: int) -> None:
    with pytest.raises(ValueError, match="unreadable cgroup"):
        parse_cgroup_limit(text, version)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3257864192\n", 3257864192), ("0", 0), ("", None), ("max", None), ("-5", None), ("1 2", None)],
)
def test_parse_cgroup_bytes(text: str, expected: int | None) -> None:
    assert parse_cgroup_bytes(text) == expected


STAT_V2 = "anon 1048576\nfile 4194304\nactive_file 1048576\ninactive_file 3145728\n"
STAT_V1 = "cache 100\ninactive_file 7\nhierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 4096\n"


@pytest.mark.parametrize(
    ("text", "version", "expected"),
    [
        pytest.param(STAT_V2, 2, 3145728, id="v2"),
        pytest.param(STAT_V1, 1, 4096, id="v1-total-wins"),
        pytest.param("inactive_file 7\n", 1, 7, id="v1-without-total"),
        pytest.param("total_inactive_file 4096\n", 2, None, id="v2-ignores-v1-name"),
        pytest.param("anon 5\n", 2, None, id="missing"),
        pytest.param("inactive_file lots\n", 2, None, id="junk"),
    ],
)
def test_parse_cgroup_reclaimable(text: str, version: int, expected: int | None) -> None:
    assert parse_cgroup_reclaimable(text, version) == expected


# ---------------------------------------------------------------- mounts and directories


def test_choose_mount_picks_the_version_and_the_root_that_holds_the_path() -> None:
    mounts = parse_cgroup_mounts(MOUNTINFO_HYBRID)
    assert choose_mount(mounts, 1, "/process_api/x") == ("/", "/sys/fs/cgroup/memory")
    assert choose_mount(mounts, 2, "/") == ("/", "/sys/fs/cgroup/unified")
    docker = parse_cgroup_mounts(MOUNTINFO_DOCKER_V1)
    assert choose_mount(docker, 1, "/docker/abc") == ("/docker/abc", "/sys/fs/cgroup/memory")
    assert choose_mount(docker, 1, "/elsewhere") is None
    assert choose_mount(docker, 2, "/docker/abc") is None
    # A bind mount of a sub-tree beside the whole hierarchy: the longer root wins.
    both = ((1, "/", "/a"), (1, "/docker", "/b"))
    assert choose_mount(both, 1, "/docker/abc") == ("/docker", "/b")


@pytest.mark.parametrize(
    ("path", "root", "point", "expected"),
    [
        pytest.param("/a/b/c", "/", "/sys/fs/cgroup", ("/sys/fs/cgroup/a/b/c", "/sys/fs/cgroup/a/b",
                                                       "/sys/fs/cgroup/a", "/sys/fs/cgroup"), id="nested"),
        pytest.param("/", "/", "/sys/fs/cgroup", ("/sys/fs/cgroup",), id="root"),
        pytest.param("/docker/abc", "/docker/abc", "/sys/fs/cgroup/memory", ("/sys/fs/cgroup/memory",),
                     id="subtree-mount-is-the-top"),
        pytest.param("/docker/abc/sub", "/docker/abc", "/m", ("/m/sub", "/m"), id="below-subtree"),
        pytest.param("/other", "/docker", "/m", None, id="outside-the-mount"),
        pytest.param("/dockerx", "/docker", "/m", None, id="prefix-is-not-a-parent"),
        pytest.param("/../..", "/", "/m", None, id="climbs-out"),
        pytest.param("/a//b/", "/", "/m", ("/m/a/b", "/m/a", "/m"), id="empty-parts"),
    ],
)
def test_cgroup_dirs(path: str, root: str, point: str, expected: tuple[str, ...] | None) -> None:
    assert cgroup_dirs(path, root, point) == expected


# ---------------------------------------------------------------- the binding level


def _level(name: str, limit: int | None, current: int | None = None, reclaimable: int | None = None) -> CgroupLevel:
    return CgroupLevel(limit_path=f"/sys/fs/cgroup/{name}/memory.max", limit_bytes=limit, current_bytes=current,
                       reclaimable_bytes=reclaimable)


def test_the_smallest_limit_on_the_path_binds_when_nothing_is_in_use() -> None:
    levels = [_level("a/b", None, 0), _level("a", 64 * GiB, 0), _level("", 128 * GiB, 0)]
    cgroup = binding_cgroup(2, "/a/b", levels)
    assert (cgroup.state, cgroup.limit_bytes, cgroup.limit_path) == ("limited", 64 * GiB,
                                                                     "/sys/fs/cgroup/a/memory.max")
    assert cgroup.cgroup_path == "/a/b"


def test_the_level_with_least_room_binds_not_the_smallest_limit() -> None:
    # The parent is larger but nearly full (its other children use it): it binds.
    levels = [_level("a/b", 50 * GiB, 1 * GiB), _level("a", 100 * GiB, 90 * GiB)]
    cgroup = binding_cgroup(2, "/a/b", levels)
    assert (cgroup.limit_bytes, cgroup.current_bytes, cgroup.headroom_bytes) == (100 * GiB, 90 * GiB, 10 * GiB)


def test_reclaimable_cache_counts_as_room() -> None:
    # a: 4 GiB free but 20 GiB of cache, so 24 GiB of room; its parent: 20 GiB of room.
    levels = [_level("a", 64 * GiB, 60 * GiB, 20 * GiB), _level("", 100 * GiB, 80 * GiB, 0)]
    cgroup = binding_cgroup(2, "/a", levels)
    assert (cgroup.limit_bytes, cgroup.headroom_bytes) == (100 * GiB, 20 * GiB)
    assert binding_cgroup(2, "/a", levels[:1]).headroom_bytes == 24 * GiB
    without_cache = [attrs.evolve(levels[0], reclaimable_bytes=None), levels[1]]
    assert binding_cgroup(2, "/a", without_cache).limit_bytes == 64 * GiB


def test_no_limit_on_the_path_is_unlimited_with_the_own_cgroups_readings() -> None:
    cgroup = binding_cgroup(1, "/x", [_level("x", None, 5), _level("", None, 9)])
    assert cgroup.state == "unlimited"
    assert (cgroup.version, cgroup.limit_bytes, cgroup.current_bytes, cgroup.headroom_bytes) == (1, None, 5, None)
    assert cgroup.limit_path == "/sys/fs/cgroup/x/memory.max"


def test_a_tie_binds_at_the_level_nearest_the_process() -> None:
    cgroup = binding_cgroup(2, "/a/b", [_level("a/b", 8 * GiB, 0), _level("a", 8 * GiB, 0)])
    assert cgroup.limit_path == "/sys/fs/cgroup/a/b/memory.max"


@pytest.mark.parametrize(("version", "levels"), [(2, []), (0, [_level("a", 1)]), (3, [_level("a", 1)])])
def test_binding_cgroup_refuses_nonsense(version: int, levels: list[CgroupLevel]) -> None:
    with pytest.raises(PlanError):
        binding_cgroup(version, "/a", levels)


# ---------------------------------------------------------------- the value


def test_unknown_and_unlimited_are_distinct() -> None:
    unknown = CgroupMemory()
    unlimited = CgroupMemory(version=2, limit_path="/sys/fs/cgroup/memory.max")
    limited = CgroupMemory(version=2, limit_bytes=GiB, current_bytes=0, limit_path="/sys/fs/cgroup/x/memory.max")
    assert (unknown.state, unlimited.state, limited.state) == ("unknown", "unlimited", "limited")
    assert unknown != unlimited
    assert unknown.limit_bytes is None and unlimited.limit_bytes is None
    assert (unknown.headroom_bytes, unlimited.headroom_bytes, limited.headroom_bytes) == (None, None, GiB)
    assert limited.source == "cgroup v2 memory.max at /sys/fs/cgroup/x"
    assert CgroupMemory(version=1, limit_bytes=1, limit_path="/m/memory.limit_in_bytes").source == (
        "cgroup v1 memory.limit_in_bytes at /m")


def test_headroom_is_never_negative_and_needs_the_usage() -> None:
    over = CgroupMemory(version=2, limit_bytes=GiB, current_bytes=2 * GiB, limit_path="/x/memory.max")
    assert over.headroom_bytes == 0
    unread = CgroupMemory(version=2, limit_bytes=GiB, limit_path="/x/memory.max")
    assert unread.headroom_bytes is None
    # Reclaimable cache beyond the usage (a torn reading) counts only up to the usage.
    torn = CgroupMemory(version=2, limit_bytes=GiB, current_bytes=GiB // 2, reclaimable_bytes=4 * GiB,
                        limit_path="/x/memory.max")
    assert torn.headroom_bytes == GiB


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"version": 3}, "version"),
        ({"version": True}, "version"),
        ({"version": 2, "limit_bytes": -1}, "limit_bytes"),
        ({"version": 2, "current_bytes": 1.5}, "current_bytes"),
        ({"version": 2, "limit_path": None}, "limit_path"),
        ({"limit_bytes": 5}, "limit_bytes"),  # unknown, yet a limit
        ({"current_bytes": 5}, "current_bytes"),
        ({"limit_path": "/x"}, "limit_path"),
    ],
)
def test_cgroup_memory_is_validated_naming_the_field(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(PlanError) as caught:
        CgroupMemory(**kwargs)  # type: ignore[arg-type]  # bad values on purpose
    assert caught.value.name == name


def test_platform_refuses_a_cgroup_that_is_not_one() -> None:
    with pytest.raises(PlanError) as caught:
        Platform(cgroup_memory={"version": 2})  # type: ignore[arg-type]  # a dict on purpose
    assert caught.value.name == "cgroup_memory"


def test_usage_is_out_of_the_fingerprint_and_the_limit_in() -> None:
    cgroup = CgroupMemory(version=2, limit_bytes=64 * GiB, current_bytes=GiB, reclaimable_bytes=0,
                          limit_path="/sys/fs/cgroup/x/memory.max", cgroup_path="/x")
    env = EnvSnapshot(platform=Platform(cgroup_memory=cgroup))

    def with_cgroup(**changes: Any) -> EnvSnapshot:
        return EnvSnapshot(platform=Platform(cgroup_memory=attrs.evolve(cgroup, **changes)))

    assert with_cgroup(current_bytes=7 * GiB, reclaimable_bytes=GiB).fingerprint() == env.fingerprint()
    assert with_cgroup(limit_bytes=32 * GiB).fingerprint() != env.fingerprint()
    assert with_cgroup(limit_bytes=None).fingerprint() != env.fingerprint()
    assert EnvSnapshot().fingerprint() != env.fingerprint()
