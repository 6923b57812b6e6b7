"""Reading ``/proc`` for the platform: `read_proc_text` (the real `ReadText`), the paths
read, and what `probe_platform` takes of them (WSL, the locked-memory limit, host memory),
each unreadable value a safe assumption with a note."""

from __future__ import annotations

from collections.abc import Callable

from offload.logs import logger
from offload.pure.env.procfs import is_wsl_release, parse_meminfo, parse_memlock_limit

__all__ = ["LIMITS_PATH", "MAPS_PATH", "MEMINFO_PATH", "OSRELEASE_PATH", "VERSION_PATH", "ReadText",
           "probe_meminfo", "probe_memlock", "probe_wsl", "read_proc_text"]

_log = logger("offload.env")

#: Reads a whole text file by path; None when it cannot be read.
ReadText = Callable[[str], str | None]

MAPS_PATH = "/proc/self/maps"
LIMITS_PATH = "/proc/self/limits"
MEMINFO_PATH = "/proc/meminfo"
OSRELEASE_PATH = "/proc/sys/kernel/osrelease"
VERSION_PATH = "/proc/version"


def read_proc_text(path: str) -> str | None:
    """Read a whole text file; the real `ReadText`.

    Args:
        path: the file, e.g. ``/proc/meminfo``.

    Returns:
        Its text (undecodable bytes replaced), or None when it cannot be opened or read.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError as exc:
        _log.debug("cannot read %s: %s", path, exc)
        return None


def probe_wsl(read_text: ReadText, notes: list[str]) -> bool:
    for path in (OSRELEASE_PATH, VERSION_PATH):
        text = read_text(path)
        if text is not None:
            return is_wsl_release(text)
    notes.append(f"could not read {OSRELEASE_PATH} or {VERSION_PATH}; assumed not WSL")
    return False


def probe_memlock(read_text: ReadText, notes: list[str]) -> int | None:
    text = read_text(LIMITS_PATH)
    if text is None:
        notes.append(f"could not read {LIMITS_PATH}; assumed no locked-memory limit")
        return None
    try:
        return parse_memlock_limit(text)
    except ValueError as exc:
        notes.append(f"{LIMITS_PATH}: {exc}; assumed no locked-memory limit")
        return None


def probe_meminfo(read_text: ReadText, notes: list[str]) -> tuple[int | None, int | None]:
    text = read_text(MEMINFO_PATH)
    if text is None:
        notes.append(f"could not read {MEMINFO_PATH}; host memory unknown, not checked")
        return None, None
    total, available = parse_meminfo(text)
    if total is None:
        notes.append(f"no MemTotal in {MEMINFO_PATH}; host memory size unknown")
    if available is None:
        notes.append(f"no MemAvailable in {MEMINFO_PATH}; available host memory unknown, not checked")
    return total, available
