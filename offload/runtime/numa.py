"""Bind fresh host mappings to a NUMA node before their pages are first touched.

Linux gives a page the node of the thread that first touches it, unless the mapping has
a memory policy. `HostPlacer.place` sets one with ``mbind(2)`` (MPOL_PREFERRED: the pages
go to the node while it has room, then elsewhere, where MPOL_BIND would make a fault on
a full node fail, which on a shared mapping is SIGBUS). It calls the system call through
libc's ``syscall`` (libnuma is not needed); where that is unavailable or refused (an
unknown architecture, a seccomp filter's EPERM, a kernel without NUMA's ENOSYS) the
memory simply stays unplaced: the reason is logged once per placer and kept in
`HostPlacer.fallback_reason`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from collections.abc import Callable, Sequence
from typing import final

from offload.logs import logger

__all__ = [
    "MPOL_BIND",
    "MPOL_PREFERRED",
    "SYS_MBIND",
    "HostPlacer",
    "Mbind",
    "libc_mbind",
    "node_mask",
]

log = logger("offload.host")

# Memory policy modes (linux/mempolicy.h).
MPOL_PREFERRED = 1
MPOL_BIND = 2

#: The mbind system call's number by machine (``platform.machine()``): x86_64's table,
#: and the generic table that aarch64 uses.
SYS_MBIND = {"x86_64": 237, "amd64": 237, "aarch64": 235, "arm64": 235}

#: ``mbind(address, length, mode, nodemask words, maxnode, flags) -> errno`` (0 for
#: success). The real one is `libc_mbind`; tests pass fakes that fail.
Mbind = Callable[[int, int, int, Sequence[int], int, int], int]

# Errors that say the call will never work in this process: stop asking.
_PERMANENT = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES})

_WORD_BITS = 64


def node_mask(node: int) -> tuple[tuple[int, ...], int]:
    """The nodemask words (64-bit, least significant first) with only `node` set, and
    the ``maxnode`` to pass with them (the kernel reads ``maxnode - 1`` bits)."""
    words = [0] * (node // _WORD_BITS + 1)
    words[node // _WORD_BITS] = 1 << (node % _WORD_BITS)
    return tuple(words), len(words) * _WORD_BITS + 1


def libc_mbind(machine: str | None = None) -> Mbind:
    """``mbind`` through libc's ``syscall``.

    Args:
        machine: the architecture (``platform.machine()`` when None).

    Raises:
        OSError: no system call number is known for the architecture, or libc's
            ``syscall`` cannot be found; the message says which.
    """
    arch = platform.machine() if machine is None else machine
    number = SYS_MBIND.get(arch.lower())
    if number is None:
        raise OSError(errno.ENOSYS, f"no mbind system call number known for {arch!r}")
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError) as exc:
        raise OSError(errno.ENOSYS, f"libc's syscall is unavailable: {exc}") from exc
    syscall.restype = ctypes.c_long

    def mbind(address: int, length: int, mode: int, mask: Sequence[int], maxnode: int, flags: int) -> int:
        words = (ctypes.c_ulong * len(mask))(*mask)
        result = syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length),
                         ctypes.c_long(mode), words, ctypes.c_ulong(maxnode), ctypes.c_ulong(flags))
        return 0 if result == 0 else ctypes.get_errno() or errno.EINVAL

    return mbind


@final
class HostPlacer:
    """Places fresh host mappings on one NUMA node (for `CudaRuntime`'s host copies).

    Args:
        node: the NUMA node (from the plan's `HostNuma`).
        mbind: the system call; `libc_mbind` when None (resolved on first use).
        machine: the architecture `libc_mbind` picks the call number for
            (``platform.machine()`` when None).
    """

    def __init__(self, node: int, *, mbind: Mbind | None = None, machine: str | None = None) -> None:
        value: object = node  # callers outside the type checker may pass anything
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"a NUMA node number >= 0 is needed, got {node!r}")
        self._node = node
        self._mbind = mbind
        self._machine = machine
        self._mask, self._maxnode = node_mask(node)
        self._lock = threading.Lock()
        self._placed = 0
        self._fallbacks = 0
        self._reason: str | None = None
        self._given_up = False

    @property
    def node(self) -> int:
        """The node mappings are placed on."""
        return self._node

    @property
    def placed(self) -> int:
        """How many mappings were placed."""
        return self._placed

    @property
    def fallbacks(self) -> int:
        """How many mappings were left unplaced."""
        return self._fallbacks

    @property
    def fallback_reason(self) -> str | None:
        """Why the first mapping left unplaced was, or None when every one was placed."""
        return self._reason

    def place(self, address: int, length: int) -> bool:
        """Prefer the node for the pages of ``[address, address + length)``, which must be
        a page-aligned mapping no one has touched yet (pages already there stay put).

        Returns:
            True when the policy is set; False when the memory stays unplaced (logged
            once, with the reason; never raised).
        """
        with self._lock:
            if self._given_up:
                self._fallbacks += 1
                return False
            if self._mbind is None:
                try:
                    self._mbind = libc_mbind(self._machine)
                except OSError as exc:
                    self._give_up(str(exc.strerror or exc), permanent=True)
                    return False
            code = self._mbind(address, length, MPOL_PREFERRED, self._mask, self._maxnode, 0)
            if code == 0:
                self._placed += 1
                return True
            self._give_up(f"mbind(MPOL_PREFERRED, node {self._node}) failed: "
                          f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})",
                          permanent=code in _PERMANENT)
            return False

    def _give_up(self, reason: str, *, permanent: bool) -> None:
        self._fallbacks += 1
        self._given_up = self._given_up or permanent
        if self._reason is None:
            self._reason = reason
            log.warning("host memory is not placed on NUMA node %d: %s; host copies stay where the "
                        "kernel puts them (host-to-device copies may be slower)%s", self._node, reason,
                        "; not trying again" if permanent else "")
