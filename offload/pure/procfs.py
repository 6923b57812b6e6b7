"""Parsers for the /proc texts the platform probe reads.

Each function takes the text of one file, already read by the shell (`offload.capture`),
and returns plain values. Nothing here opens a file, imports torch or logs, so the parsers
are tested with sample texts from real machines.
"""

from __future__ import annotations

import re

__all__ = [
    "find_libcudart",
    "is_wsl_release",
    "parse_meminfo",
    "parse_memlock_limit",
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
