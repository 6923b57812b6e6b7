"""This boot's id: hostname and boot id tell the hosts of a job apart (a reused hostname, a
container's, is not enough)."""

from __future__ import annotations

from offload.logs import logger

__all__ = ["BOOT_ID_PATH", "read_boot_id"]

log = logger("offload.env")

#: Where Linux says which boot this is.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot's id, or ``"unknown"`` when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return "unknown"
