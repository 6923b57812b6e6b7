"""Parsers for the /proc texts the platform probe reads.

Each function takes the text of one file, already read by the shell (`offload.capture`),
and returns plain values. Nothing here opens a file, imports torch or logs, so the parsers
are tested with sample texts from real machines.
"""

from __future__ import annotations

import re

__all__ = [
    "CGROUP_V1_UNLIMITED",
    "find_libcudart",
    "is_wsl_release",
    "parse_cgroup_bytes",
    "parse_cgroup_limit",
    "parse_cgroup_mounts",
    "parse_cgroup_reclaimable",
    "parse_meminfo",
    "parse_memlock_limit",
    "parse_proc_cgroup",
]

# Units /proc/meminfo uses. The kernel has printed "kB" (meaning KiB) since 2.6; a line
# without a unit is a count (HugePages_Total), never one of the two we read.
_MEMINFO_UNITS = {"kB": 1024, "KB": 1024, "kb": 1024}

_MEMLOCK_LINE = "Max locked memory"

# The torch wheels carry libcudart either as-is (libcudart.so.12, libcudart.so.13.0.96 from
# the nvidia-cuda-runtime wheel or a system toolkit) or renamed by auditwheel with a hash
# (torch.libs/libcudart-9335f6a2.so.12).
_LIBCUDART = re.compile(r"^libcudart(?:-[0-9a-f]+)?\.so(?:\.([0-9]+)(?:\.[0-9]+)*)?$")


def _is_number(text: str) -> bool:
    # ASCII digits only: str.isdigit() also accepts "²", which int() rejects.
    return text.isascii() and text.isdigit()


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """Read total and available host memory from the text of ``/proc/meminfo``.

    Lines that are not ``Name: number [unit]`` are skipped, so odd or truncated text gives
    None for what it lacks instead of an error.

    Args:
        text: the whole file, e.g. ``"MemTotal:  24683656 kB\\nMemAvailable: ..."``.

    Returns:
        ``(MemTotal, MemAvailable)`` in bytes (the file's kB are KiB, times 1024); each is
        None when its line is missing or unreadable. MemAvailable is missing on kernels
        older than 3.14.

    Raises:
        Nothing.
    """
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key.strip() not in ("MemTotal", "MemAvailable"):
            continue
        fields = rest.split()
        if not fields or not _is_number(fields[0]):
            continue
        if len(fields) == 1:
            scale = 1
        elif len(fields) == 2 and fields[1] in _MEMINFO_UNITS:
            scale = _MEMINFO_UNITS[fields[1]]
        else:
            continue
        # The first occurrence wins, as for any reader that stops at the first match.
        values.setdefault(key.strip(), int(fields[0]) * scale)
    return values.get("MemTotal"), values.get("MemAvailable")


def parse_memlock_limit(text: str) -> int | None:
    """Read the soft locked-memory limit (``ulimit -l``) from ``/proc/self/limits``.

    Args:
        text: the whole file; the line read looks like
            ``Max locked memory   8388608   8388608   bytes``.

    Returns:
        The soft limit in bytes (the file states it in bytes), or None for ``unlimited``.

    Raises:
        ValueError: the text has no readable "Max locked memory" line. This is not
            ignored, because the only "no limit" answer, None, would then be a guess.
    """
    for line in text.splitlines():
        if not line.startswith(_MEMLOCK_LINE):
            continue
        fields = line[len(_MEMLOCK_LINE):].split()
        if fields:
            soft = fields[0]
            if soft == "unlimited":
                return None
            if _is_number(soft):
                return int(soft)
        raise ValueError(f"unreadable locked-memory limit line: {line!r}")
    raise ValueError(f"no {_MEMLOCK_LINE!r} line in the limits text")


def is_wsl_release(text: str) -> bool:
    """Tell whether a kernel release string comes from Windows Subsystem for Linux.

    Args:
        text: ``/proc/sys/kernel/osrelease`` (``5.15.167.4-microsoft-standard-WSL2``) or
            ``/proc/version``; WSL 1 reports ``4.4.0-19041-Microsoft``.

    Returns:
        True when the text contains "microsoft" or "WSL" in any case; False otherwise,
        including for empty text.

    Raises:
        Nothing.
    """
    lowered = text.lower()
    return "microsoft" in lowered or "wsl" in lowered


def find_libcudart(maps_text: str, cuda_major: str | None = None) -> str | None:
    """Find the CUDA runtime library mapped into this process.

    Args:
        maps_text: ``/proc/self/maps``; each line is ``address perms offset dev inode
            [path]``, and the path may contain spaces.
        cuda_major: the CUDA major version torch was built with (``"13"`` for
            ``torch.version.cuda == "13.0"``): where several runtimes are mapped (an
            extension may bring its own), the first of that version is torch's.

    Returns:
        The path of the first mapped ``libcudart.so[.N...]`` (or auditwheel's
        ``libcudart-<hash>.so[.N]``) of version `cuda_major`, or else the first of any
        version, in address order; None when there is none. Static archives, similarly
        named libraries (``libcudart_static``) and mappings of deleted files (which cannot
        be opened again by path) are skipped.

    Raises:
        Nothing; malformed lines are skipped.
    """
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)") or not path.startswith("/"):
            continue
        match = _LIBCUDART.match(path.rsplit("/", 1)[-1])
        if match:
            if cuda_major is None or match.group(1) == cuda_major:
                return path
            found.append(path)
    return found[0] if found else None


# ---- cgroups ------------------------------------------------------------------------

#: cgroup v1 has no word for "no limit": it prints the largest page-aligned value
#: (9223372036854771712 on 4 KiB pages, 9223372036854710272 on 64 KiB). Any limit from
#: this up (2**62 bytes, 4 EiB) means none.
CGROUP_V1_UNLIMITED = 1 << 62


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """Read the process's cgroups from the text of ``/proc/self/cgroup``.

    Args:
        text: lines ``hierarchy-id:controllers:path``, e.g. ``0::/user.slice/x.scope``
            (cgroup v2: id 0, no controllers) and ``4:memory:/docker/abc`` (v1; the
            controllers are comma-separated, ``4:memory,hugetlb:/x`` also counts).

    Returns:
        ``(v2 path, v1 memory path)``: the path of the ``0::`` line and of the first v1
        line whose controllers include ``memory``; each None when there is no such line.
        Malformed lines and paths that do not start with ``/`` are skipped.

    Raises:
        Nothing.
    """
    v2: str | None = None
    v1: str | None = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "" and v2 is None:
            v2 = path
        elif "memory" in controllers.split(",") and v1 is None:
            v1 = path
    return v2, v1


def _unescape_mount_field(text: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def parse_cgroup_mounts(text: str) -> tuple[tuple[int, str, str], ...]:
    """Find the cgroup mounts in the text of ``/proc/self/mountinfo``.

    Args:
        text: lines ``id parent major:minor root mount-point options [optional...] -
            fstype source super-options``, e.g. ``35 31 0:32 / /sys/fs/cgroup/memory rw
            - cgroup cgroup rw,memory``.

    Returns:
        ``(version, root, mount point)`` for each ``cgroup2`` mount (version 2) and each
        ``cgroup`` mount with the ``memory`` controller (version 1), in file order;
        ``root`` is the directory of the hierarchy mounted there (``/`` unless a
        sub-tree is). Octal escapes in paths (``\\040``) are decoded. Other lines and
        malformed ones are skipped.

    Raises:
        Nothing.
    """
    mounts: list[tuple[int, str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 5 or len(tail) < 1:
            continue
        root, point = _unescape_mount_field(fields[3]), _unescape_mount_field(fields[4])
        if tail[0] == "cgroup2":
            mounts.append((2, root, point))
        elif tail[0] == "cgroup" and len(tail) >= 3 and "memory" in tail[2].split(","):
            mounts.append((1, root, point))
    return tuple(mounts)


def parse_cgroup_limit(text: str, version: int) -> int | None:
    """Read a cgroup memory limit: ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1).

    Args:
        text: the file, e.g. ``"68719476736\n"``; v2 writes ``max`` for no limit, v1 a
            huge number (9223372036854771712).
        version: 2 or 1.

    Returns:
        The limit in bytes (the files state bytes), or None for no limit: v2 ``max``, or
        a v1 value of at least `CGROUP_V1_UNLIMITED` (2**62); ``-1`` also means none.

    Raises:
        ValueError: the text is not one of those; not ignored, because None ("no limit")
            would then be a guess.
    """
    value = text.strip()
    if version == 2 and value == "max":
        return None
    if value == "-1":
        return None
    if not _is_number(value):
        raise ValueError(f"unreadable cgroup v{version} memory limit {value[:40]!r}")
    number = int(value)
    if number >= CGROUP_V1_UNLIMITED:
        return None
    return number


def parse_cgroup_bytes(text: str) -> int | None:
    """Read a cgroup usage file (``memory.current``, ``memory.usage_in_bytes``).

    Returns:
        The bytes it states, or None when the text is not one number.

    Raises:
        Nothing.
    """
    value = text.strip()
    return int(value) if _is_number(value) else None


def parse_cgroup_reclaimable(text: str, version: int) -> int | None:
    """Read the inactive file cache from a cgroup's ``memory.stat``.

    This is the part of the usage the kernel reclaims first, before the OOM killer acts
    (container runtimes subtract it too: "working set" = usage - inactive file).

    Args:
        text: lines ``name value`` (bytes), e.g. ``inactive_file 1048576``.
        version: 2 reads ``inactive_file``; 1 reads ``total_inactive_file`` (the cgroup
            and its descendants, as its usage counts them), else ``inactive_file``.

    Returns:
        The bytes, or None when the line is missing or unreadable.

    Raises:
        Nothing.
    """
    values: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and _is_number(fields[1]):
            values.setdefault(fields[0], int(fields[1]))
    names = ("inactive_file",) if version == 2 else ("total_inactive_file", "inactive_file")
    for name in names:
        if name in values:
            return values[name]
    return None
