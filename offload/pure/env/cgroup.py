"""The memory limit of this process's cgroup, as a value; and how it is worked out.

A container's memory limit is its cgroup's: ``memory.max`` (cgroup v2) or
``memory.limit_in_bytes`` (v1). The kernel's OOM killer enforces it, whatever
``/proc/meminfo`` says about the host, and it kills without a traceback. Every cgroup on
the path from the process's own up to the root of the hierarchy limits it; the one that
binds is the one with the least room left.

The shell (`offload.capture`) reads the files; the texts are parsed in
`offload.pure.env.procfs`; this module holds the value `Platform.cgroup_memory` keeps and the
pure steps between them: which mount, which directories, which level binds. It depends on
nothing but the error tree and the shared validators, because `Platform` holds a
`CgroupMemory`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from offload.errors import OffloadError, PlanError
from offload.pure._checks import VOLATILE, int_at_least, is_str

__all__ = [
    "CGROUP_STATES",
    "CgroupLevel",
    "CgroupMemory",
    "binding_cgroup",
    "cgroup_dirs",
    "cgroup_memory",
    "choose_mount",
    "limit_file",
    "usage_file",
]

#: What `CgroupMemory.state` says.
CGROUP_STATES = ("limited", "unlimited", "unknown")

_LIMIT_FILE = {2: "memory.max", 1: "memory.limit_in_bytes"}
_USAGE_FILE = {2: "memory.current", 1: "memory.usage_in_bytes"}


def limit_file(version: int) -> str:
    """The limit file's name in a cgroup directory: ``memory.max`` (v2) or
    ``memory.limit_in_bytes`` (v1)."""
    return _LIMIT_FILE[version]


def usage_file(version: int) -> str:
    """The usage file's name: ``memory.current`` (v2) or ``memory.usage_in_bytes`` (v1)."""
    return _USAGE_FILE[version]


def _version(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value not in (0, 1, 2):
        raise PlanError(f"{attribute.name} must be 0 (unknown), 1 or 2, got {value!r}",
                        name=attribute.name, value=value)


_OPTIONAL_BYTES = int_at_least(0, PlanError, optional=True)


@attrs.frozen(kw_only=True)
class CgroupMemory:
    """The memory limit the kernel enforces on this process's cgroup. The defaults mean
    unknown (nothing was read).

    Unlimited and unknown are told apart by `version`: a known hierarchy without a limit
    on the path is unlimited (`limit_bytes` None, `version` 1 or 2); nothing read is
    unknown (`version` 0). `state` says it in a word.

    Attributes:
        version: the hierarchy the memory controller was read from: 2 (``memory.max``),
            1 (``memory.limit_in_bytes``), or 0 when none could be read.
        limit_bytes: the binding limit, in bytes: of the cgroups from this process's up to
            the top of the hierarchy, the limit of the one with the least room left; None
            when none of them has a limit (v2 ``max``, v1's "unlimited", a number >= 2**62)
            or when unknown.
        current_bytes: memory charged to that cgroup (``memory.current`` /
            ``memory.usage_in_bytes``), in bytes; None when unread. A reading of the moment.
        reclaimable_bytes: its inactive file cache (``inactive_file`` in v2's
            ``memory.stat``, ``total_inactive_file`` in v1's), in bytes, which the kernel
            reclaims before it kills; None when unread. A reading of the moment.
        limit_path: the file the binding limit was read from (for unlimited, the process's
            own cgroup's, where there is one); empty when unknown.
        cgroup_path: the process's cgroup as ``/proc/self/cgroup`` names it; empty when
            that could not be read (it may be known while the limit is not).
    """

    version: int = attrs.field(default=0, validator=_version)
    limit_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES)
    current_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES, metadata={VOLATILE: True})
    reclaimable_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES, metadata={VOLATILE: True})
    limit_path: str = attrs.field(default="", validator=is_str(PlanError))
    cgroup_path: str = attrs.field(default="", validator=is_str(PlanError))

    def __attrs_post_init__(self) -> None:
        if self.version == 0:
            for name in ("limit_bytes", "current_bytes", "reclaimable_bytes", "limit_path"):
                value = getattr(self, name)
                if value not in (None, ""):
                    raise PlanError(f"an unknown cgroup (version 0) has no {name}, got {value!r}",
                                    name=name, value=value)

    @property
    def state(self) -> str:
        """``"limited"``, ``"unlimited"`` or ``"unknown"`` (one of `CGROUP_STATES`)."""
        if self.version == 0:
            return "unknown"
        return "unlimited" if self.limit_bytes is None else "limited"

    @property
    def headroom_bytes(self) -> int | None:
        """Bytes the cgroup may still take before the OOM killer acts: the limit minus the
        usage, plus the reclaimable file cache (never below 0). None when unlimited,
        unknown, or the usage is unread."""
        if self.limit_bytes is None or self.current_bytes is None:
            return None
        reclaimable = min(self.reclaimable_bytes or 0, self.current_bytes)
        return max(0, self.limit_bytes - self.current_bytes + reclaimable)

    @property
    def source(self) -> str:
        """Where the limit comes from, for messages: ``cgroup v2 memory.max at
        /sys/fs/cgroup/user.slice`` (the directory of `limit_path`)."""
        if self.version == 0:
            return "cgroup memory limit unknown"
        name = limit_file(self.version)
        directory, file = posixpath.split(self.limit_path)
        where = f" at {directory}" if file == name else f" ({self.limit_path})" if self.limit_path else ""
        return f"cgroup v{self.version} {name}{where}"


def cgroup_memory(error: type[OffloadError]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """A validator accepting a `CgroupMemory`, raising `error` naming the field otherwise."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, CgroupMemory):
            raise error(f"{attribute.name} must be a CgroupMemory, got {value!r}", name=attribute.name, value=value)

    return check


@attrs.frozen(kw_only=True)
class CgroupLevel:
    """What was read in one cgroup directory on the path.

    Attributes:
        limit_path: the limit file read.
        limit_bytes: its limit in bytes; None for no limit at this level.
        current_bytes: its usage in bytes; None when unread.
        reclaimable_bytes: its inactive file cache in bytes; None when unread.
    """

    limit_path: str = attrs.field(validator=is_str(PlanError))
    limit_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES)
    current_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES)
    reclaimable_bytes: int | None = attrs.field(default=None, validator=_OPTIONAL_BYTES)


def _room(level: CgroupLevel) -> int:
    # Only limited levels are compared; an unread usage counts as 0.
    current = level.current_bytes or 0
    return (level.limit_bytes or 0) - current + min(level.reclaimable_bytes or 0, current)


def binding_cgroup(version: int, cgroup_path: str, levels: Sequence[CgroupLevel]) -> CgroupMemory:
    """The cgroup on the path whose limit binds.

    Args:
        version: 1 or 2.
        cgroup_path: the process's cgroup (``/proc/self/cgroup``).
        levels: what was read in each directory whose limit file could be read, the
            process's own first, then its ancestors; at least one.

    Returns:
        The level with the least room (limit - usage + reclaimable cache; an unread usage
        counts as 0), the one nearest the process on a tie; unlimited, with the first
        level's readings, when no level has a limit.

    Raises:
        PlanError: `levels` is empty or `version` is not 1 or 2.
    """
    if not levels or version not in (1, 2):
        raise PlanError(f"binding_cgroup needs cgroup version 1 or 2 and at least one level, got version "
                        f"{version!r} and {len(levels)} levels", name="levels", value=len(levels))
    limited = [level for level in levels if level.limit_bytes is not None]
    chosen = min(limited, key=_room) if limited else levels[0]
    return CgroupMemory(
        version=version,
        limit_bytes=chosen.limit_bytes,
        current_bytes=chosen.current_bytes,
        reclaimable_bytes=chosen.reclaimable_bytes,
        limit_path=chosen.limit_path,
        cgroup_path=cgroup_path,
    )


def choose_mount(mounts: Sequence[tuple[int, str, str]], version: int, cgroup_path: str) -> tuple[str, str] | None:
    """The mount through which `cgroup_path` is visible.

    Args:
        mounts: (version, root within the hierarchy, mount point) of each cgroup mount
            (`offload.pure.env.procfs.parse_cgroup_mounts`: v1 ones only with the memory
            controller).
        version: the hierarchy wanted, 1 or 2.
        cgroup_path: the process's cgroup in it.

    Returns:
        (root, mount point) of the mount of that version whose root contains the path
        (the longest such root: a bind mount of a sub-tree shows more of the path's own
        limits than none); None when no mount fits.
    """
    best: tuple[str, str] | None = None
    for mount_version, root, point in mounts:
        if mount_version != version or _relative(cgroup_path, root) is None:
            continue
        if best is None or len(root) > len(best[0]):
            best = (root, point)
    return best


def _relative(path: str, root: str) -> str | None:
    if root == "/":
        return path
    if path == root:
        return "/"
    if path.startswith(root + "/"):
        return path[len(root):]
    return None


def cgroup_dirs(cgroup_path: str, root: str, mount_point: str) -> tuple[str, ...] | None:
    """The directories of the cgroup and its visible ancestors, the cgroup's own first.

    Args:
        cgroup_path: the process's cgroup (``/proc/self/cgroup``), e.g.
            ``/kubepods/burstable/pod1/abc``.
        root: the root of the mount within the hierarchy (``/`` unless a sub-tree is
            mounted, as for Docker's cgroup v1 without a cgroup namespace).
        mount_point: where that root is mounted, e.g. ``/sys/fs/cgroup``.

    Returns:
        From ``<mount point>/<path below root>`` up to the mount point itself (the top of
        what the process can see: its ancestors above belong to the host); None when the
        path does not lie below `root` or climbs out with ``..``.
    """
    relative = _relative(cgroup_path, root)
    if relative is None or not relative.startswith("/"):
        return None
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if ".." in parts:
        return None
    return tuple(posixpath.join(mount_point, *parts[:depth]) for depth in range(len(parts), -1, -1))

