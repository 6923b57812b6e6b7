"""Probe this process's cgroup memory limit and usage (part of `capture_env`).

Reads ``/proc/self/cgroup`` (which cgroup the process is in), ``/proc/self/mountinfo``
(where that hierarchy is mounted), then, in the cgroup's directory and each ancestor's up
to the top of the mount, the limit (``memory.max`` for cgroup v2, ``memory.limit_in_bytes``
for v1), the usage (``memory.current`` / ``memory.usage_in_bytes``) and the reclaimable
file cache (``memory.stat``). The memory controller is on v1 when a v1 line of
``/proc/self/cgroup`` names it (hybrid hosts mount v2 too, without it), else on v2.

Every path is taken under a root directory, so tests build a fake ``/proc`` and
``/sys/fs/cgroup`` in a temporary directory. The texts are parsed by
`offload.pure.env.procfs`, the levels combined by `offload.pure.env.cgroup`. Nothing here raises
for a missing file: what cannot be read is unknown, with one line in
`Platform.probe_notes` saying so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from offload.logs import logger
from offload.pure.env.cgroup import (
    CgroupLevel,
    CgroupMemory,
    binding_cgroup,
    cgroup_dirs,
    choose_mount,
    limit_file,
    usage_file,
)
from offload.pure.env.procfs import (
    parse_cgroup_bytes,
    parse_cgroup_limit,
    parse_cgroup_mounts,
    parse_cgroup_reclaimable,
    parse_proc_cgroup,
)
from offload.pure.env.snapshot import Platform

__all__ = ["MOUNTINFO_PATH", "PROC_CGROUP_PATH", "probe_cgroup", "with_cgroup_memory"]

_log = logger("offload.env")

PROC_CGROUP_PATH = "/proc/self/cgroup"
#: The usual mount points (cgroup version, root, mount point), when
#: ``/proc/self/mountinfo`` cannot be read.
DEFAULT_MOUNTS: tuple[tuple[int, str, str], ...] = ((2, "/", "/sys/fs/cgroup"), (1, "/", "/sys/fs/cgroup/memory"))
MOUNTINFO_PATH = "/proc/self/mountinfo"

_UNKNOWN = "the cgroup memory limit is unknown, not checked"


class _Reader:
    """Reads absolute paths under a root directory."""

    def __init__(self, root: str | Path) -> None:
        self._root = Path(root)

    def __call__(self, path: str) -> str | None:
        try:
            return (self._root / path.lstrip("/")).read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError) as exc:  # ValueError: a NUL in a path from mountinfo
            _log.debug("cannot read %s under %s: %s", path, self._root, exc)
            return None


def _level(read: _Reader, version: int, directory: str, notes: list[str]) -> CgroupLevel | None:
    path = f"{directory}/{limit_file(version)}"
    text = read(path)
    if text is None:
        return None  # no limit file here (v2: the memory controller is not enabled for this cgroup)
    try:
        limit = parse_cgroup_limit(text, version)
    except ValueError as exc:
        notes.append(f"{path}: {exc}; that cgroup's limit is not counted")
        return None
    usage = read(f"{directory}/{usage_file(version)}")
    current = parse_cgroup_bytes(usage) if usage is not None else None
    stat = read(f"{directory}/memory.stat") if limit is not None else None
    reclaimable = parse_cgroup_reclaimable(stat, version) if stat is not None else None
    return CgroupLevel(limit_path=path, limit_bytes=limit, current_bytes=current, reclaimable_bytes=reclaimable)


def probe_cgroup(root: str | Path = "/") -> tuple[CgroupMemory, tuple[str, ...]]:
    """The memory limit of this process's cgroup, read from the files under `root`.

    Args:
        root: the directory holding ``proc/`` and ``sys/`` (``/`` on a real machine).

    Returns:
        The binding limit (`CgroupMemory`: unknown when it cannot be read, unlimited when
        no cgroup on the path has one) and one note per thing that could not be read.
    """
    read = _Reader(root)
    notes: list[str] = []
    text = read(PROC_CGROUP_PATH)
    if text is None:
        return CgroupMemory(), (f"could not read {PROC_CGROUP_PATH}; {_UNKNOWN}",)
    v2_path, v1_path = parse_proc_cgroup(text)
    if v1_path is not None:
        version, path = 1, v1_path
    elif v2_path is not None:
        version, path = 2, v2_path
    else:
        return CgroupMemory(), (f"{PROC_CGROUP_PATH} names no memory cgroup (neither a 0:: line nor a v1 "
                                f"memory line); {_UNKNOWN}",)
    mountinfo = read(MOUNTINFO_PATH)
    mounts = parse_cgroup_mounts(mountinfo) if mountinfo is not None else DEFAULT_MOUNTS
    mount = choose_mount(mounts, version, path)
    if mount is None:
        where = "the usual places" if mountinfo is None else MOUNTINFO_PATH
        return CgroupMemory(cgroup_path=path), (
            f"no cgroup v{version} mount in {where} shows the process's cgroup {path}; {_UNKNOWN}",)
    dirs = cgroup_dirs(path, *mount)
    if dirs is None:
        return CgroupMemory(cgroup_path=path), (
            f"the process's cgroup {path} is not below the mount of {mount[0]} at {mount[1]}; {_UNKNOWN}",)
    levels = [level for level in (_level(read, version, d, notes) for d in dirs) if level is not None]
    if levels:
        return binding_cgroup(version, path, levels), tuple(notes)
    # v2 without memory.max anywhere on the path: the memory controller is enabled for none
    # of these cgroups, so none limits memory; if the cgroup's own directory is there at all.
    if version == 2 and read(f"{dirs[0]}/cgroup.controllers") is not None:
        return CgroupMemory(version=2, cgroup_path=path), tuple(notes)
    notes.append(f"no readable {limit_file(version)} in {dirs[0]} or above; {_UNKNOWN}")
    return CgroupMemory(cgroup_path=path), tuple(notes)


def with_cgroup_memory(platform: Platform, *, root: str | Path = "/") -> Platform:
    """`platform` with its `Platform.cgroup_memory` probed and the probe's notes added.

    Args:
        platform: from `offload.capture.probe_platform`.
        root: the directory holding ``proc/`` and ``sys/``; tests pass a fake tree.

    Returns:
        The platform with the cgroup's limit; notes are logged as the capture logs its own
        (warning on a CUDA machine, debug otherwise).
    """
    cgroup, notes = probe_cgroup(root)
    level = logging.WARNING if platform.has_cuda else logging.DEBUG
    for note in notes:
        _log.log(level, "platform probe: %s", note)
    return attrs.evolve(platform, cgroup_memory=cgroup, probe_notes=(*platform.probe_notes, *notes))
