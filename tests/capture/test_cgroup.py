"""The cgroup probe against fake /proc and /sys/fs/cgroup trees in a temporary directory:
it finds the binding limit, and never raises where files are missing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from offload.capture import capture_env
from offload.capture.cgroup import probe_cgroup, with_cgroup_memory
from offload.pure import CgroupMemory, Platform

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712\n"

MOUNTINFO_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
MOUNTINFO_HYBRID = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
MOUNTINFO_DOCKER_V1 = "720 711 0:31 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` (absolute paths) under `root`."""
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def v2_dir(path: str, *, limit: str | None, current: int | None = None, stat: str | None = None) -> dict[str, str]:
    """The files of one cgroup v2 directory."""
    files = {f"{path}/cgroup.controllers": "cpu memory\n"}
    if limit is not None:
        files[f"{path}/memory.max"] = limit
    if current is not None:
        files[f"{path}/memory.current"] = f"{current}\n"
    if stat is not None:
        files[f"{path}/memory.stat"] = stat
    return files


def test_v2_nested_path_the_ancestor_with_least_room_binds(tmp_path: Path) -> None:
    base = "/sys/fs/cgroup/kubepods.slice/pod1.slice"
    root = tree(tmp_path, {
        "/proc/self/cgroup": "0::/kubepods.slice/pod1.slice/cri-2.scope\n",
        "/proc/self/mountinfo": MOUNTINFO_V2,
        **v2_dir("/sys/fs/cgroup", limit=None),  # the root cgroup has no memory.max
        **v2_dir("/sys/fs/cgroup/kubepods.slice", limit="max\n", current=40 * GiB),
        **v2_dir(base, limit=f"{64 * GiB}\n", current=60 * GiB, stat=f"anon 1\ninactive_file {2 * GiB}\n"),
        **v2_dir(f"{base}/cri-2.scope", limit="max\n", current=60 * GiB),
    })
    cgroup, notes = probe_cgroup(root)
    assert notes == ()
    assert cgroup == CgroupMemory(
        version=2, limit_bytes=64 * GiB, current_bytes=60 * GiB, reclaimable_bytes=2 * GiB,
        limit_path=f"{base}/memory.max", cgroup_path="/kubepods.slice/pod1.slice/cri-2.scope",
    )
    assert cgroup.headroom_bytes == 6 * GiB


def test_v2_max_everywhere_is_unlimited(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "/proc/self/cgroup": "0::/user.slice/s.scope\n",
        "/proc/self/mountinfo": MOUNTINFO_V2,
        **v2_dir("/sys/fs/cgroup/user.slice", limit="max\n", current=GiB),
        **v2_dir("/sys/fs/cgroup/user.slice/s.scope", limit="max\n", current=123),
    })
    cgroup, notes = probe_cgroup(root)
    assert notes == ()
    assert cgroup.state == "unlimited"
    assert (cgroup.version, cgroup.current_bytes) == (2, 123)
    assert cgroup.limit_path == "/sys/fs/cgroup/user.slice/s.scope/memory.max"


def test_v2_without_the_memory_controller_is_unlimited(tmp_path: Path) -> None:
    # The cgroup exists, but no cgroup on the path has memory.max: nothing limits memory.
    root = tree(tmp_path, {
        "/proc/self/cgroup": "0::/a\n",
        "/proc/self/mountinfo": MOUNTINFO_V2,
        **v2_dir("/sys/fs/cgroup/a", limit=None),
    })
    assert probe_cgroup(root) == (CgroupMemory(version=2, cgroup_path="/a"), ())


def test_v2_cgroup_directory_missing_is_unknown_with_a_note(tmp_path: Path) -> None:
    root = tree(tmp_path, {"/proc/self/cgroup": "0::/gone\n", "/proc/self/mountinfo": MOUNTINFO_V2})
    cgroup, notes = probe_cgroup(root)
    assert cgroup == CgroupMemory(cgroup_path="/gone")
    assert cgroup.state == "unknown"
    assert notes == ("no readable memory.max in /sys/fs/cgroup/gone or above; the cgroup memory limit is unknown, "
                     "not checked",)


def test_v1_huge_number_is_unlimited_on_a_hybrid_host(tmp_path: Path) -> None:
    # This CPU machine's layout (FACTS.md): v1 memory controller, v2 mounted beside it.
    own = "/sys/fs/cgroup/memory/process_api/8b26"
    root = tree(tmp_path, {
        "/proc/self/cgroup": "4:memory:/process_api/8b26\n3:cpuset:/\n0::/\n",
        "/proc/self/mountinfo": MOUNTINFO_HYBRID,
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": V1_UNLIMITED,
        f"{own}/memory.limit_in_bytes": V1_UNLIMITED,
        f"{own}/memory.usage_in_bytes": "3257864192\n",
        "/sys/fs/cgroup/unified/cgroup.controllers": "\n",
    })
    cgroup, notes = probe_cgroup(root)
    assert notes == ()
    assert cgroup == CgroupMemory(version=1, current_bytes=3257864192, limit_path=f"{own}/memory.limit_in_bytes",
                                  cgroup_path="/process_api/8b26")
    assert cgroup.state == "unlimited"


def test_v1_limit_of_a_parent_binds(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "/proc/self/cgroup": "4:memory:/jobs/7\n",
        "/proc/self/mountinfo": MOUNTINFO_HYBRID,
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        "/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": f"{16 * GiB}\n",
        "/sys/fs/cgroup/memory/jobs/memory.usage_in_bytes": f"{4 * GiB}\n",
        "/sys/fs/cgroup/memory/jobs/memory.stat": f"inactive_file 1\ntotal_inactive_file {GiB}\n",
        "/sys/fs/cgroup/memory/jobs/7/memory.limit_in_bytes": V1_UNLIMITED,
        "/sys/fs/cgroup/memory/jobs/7/memory.usage_in_bytes": f"{2 * GiB}\n",
    })
    cgroup, notes = probe_cgroup(root)
    assert notes == ()
    assert (cgroup.version, cgroup.limit_bytes, cgroup.current_bytes, cgroup.reclaimable_bytes) == (
        1, 16 * GiB, 4 * GiB, GiB)
    assert cgroup.limit_path == "/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes"
    assert cgroup.headroom_bytes == 13 * GiB


def test_docker_v1_subtree_mount_reads_the_mount_point(tmp_path: Path) -> None:
    # Without a cgroup namespace, /proc/self/cgroup names /docker/abc, but that directory
    # is what is mounted at /sys/fs/cgroup/memory.
    root = tree(tmp_path, {
        "/proc/self/cgroup": "11:memory:/docker/abc\n",
        "/proc/self/mountinfo": MOUNTINFO_DOCKER_V1,
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{8 * GiB}\n",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GiB}\n",
    })
    cgroup, notes = probe_cgroup(root)
    assert notes == ()
    assert (cgroup.limit_bytes, cgroup.limit_path) == (8 * GiB, "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def test_without_mountinfo_the_usual_mount_points_are_tried(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "/proc/self/cgroup": "0::/a\n",
        **v2_dir("/sys/fs/cgroup/a", limit=f"{GiB}\n", current=0),
    })
    cgroup, notes = probe_cgroup(root)
    assert (cgroup.limit_bytes, notes) == (GiB, ())


@pytest.mark.parametrize(
    ("files", "note"),
    [
        pytest.param({}, "could not read /proc/self/cgroup; the cgroup memory limit is unknown, not checked",
                     id="no-proc"),
        pytest.param({"/proc/self/cgroup": "3:cpuset:/\n"}, "names no memory cgroup", id="no-memory-line"),
        pytest.param({"/proc/self/cgroup": "4:memory:/x\n", "/proc/self/mountinfo": MOUNTINFO_V2},
                     "no cgroup v1 mount in /proc/self/mountinfo shows the process's cgroup /x", id="no-v1-mount"),
        pytest.param({"/proc/self/cgroup": "4:memory:/elsewhere\n", "/proc/self/mountinfo": MOUNTINFO_DOCKER_V1},
                     "no cgroup v1 mount", id="path-outside-the-mount"),
        pytest.param({"/proc/self/cgroup": "4:memory:/x\n", "/proc/self/mountinfo": MOUNTINFO_HYBRID},
                     "no readable memory.limit_in_bytes in /sys/fs/cgroup/memory/x or above", id="v1-files-missing"),
    ],
)
def test_what_cannot_be_read_is_unknown_with_one_note(tmp_path: Path, files: dict[str, str], note: str) -> None:
    cgroup, notes = probe_cgroup(tree(tmp_path, files))
    assert cgroup.state == "unknown"
    assert cgroup.limit_bytes is None
    assert len(notes) == 1
    assert note in notes[0]


def test_an_unreadable_limit_is_skipped_with_a_note(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "/proc/self/cgroup": "0::/a\n",
        "/proc/self/mountinfo": MOUNTINFO_V2,
        **v2_dir("/sys/fs/cgroup", limit=f"{4 * GiB}\n", current=0),
        **v2_dir("/sys/fs/cgroup/a", limit="lots\n"),
    })
    cgroup, notes = probe_cgroup(root)
    assert cgroup.limit_bytes == 4 * GiB  # the readable ancestor still counts
    assert notes == ("/sys/fs/cgroup/a/memory.max: unreadable cgroup v2 memory limit 'lots'; that cgroup's limit "
                     "is not counted",)


def test_with_cgroup_memory_adds_the_limit_and_logs_notes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="offload.env")
    platform = Platform(probe_notes=("earlier note",))
    done = with_cgroup_memory(platform, root=tmp_path)  # an empty tree
    assert done.cgroup_memory == CgroupMemory()
    assert done.probe_notes[0] == "earlier note"
    assert done.probe_notes[1].startswith("could not read /proc/self/cgroup")
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("platform probe:")] == [logging.DEBUG]
    gpu = with_cgroup_memory(Platform(has_cuda=True), root=tmp_path)
    assert gpu.probe_notes == done.probe_notes[1:]
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_capture_env_reads_this_machines_cgroup() -> None:
    env = capture_env({})
    cgroup = env.platform.cgroup_memory
    readable = Path("/proc/self/cgroup").is_file() and Path("/sys/fs/cgroup").is_dir()
    if not readable:  # a machine without cgroups: unknown, and the probe says so
        assert cgroup.state == "unknown"
        assert any("cgroup" in note for note in env.platform.probe_notes)
        return
    # This machine's memory cgroup is v1 and unlimited (FACTS.md); elsewhere at least known.
    assert cgroup.state in ("limited", "unlimited")
    assert cgroup.version in (1, 2)
    assert cgroup.limit_path.startswith("/sys/fs/cgroup/")
    assert Path(cgroup.limit_path).is_file()
    assert not any("cgroup" in note for note in env.platform.probe_notes)
