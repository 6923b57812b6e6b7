"""Page-locking slots of a shared segment with ``cudaHostRegister``, as the plan says.

`offload.runtime.hostmem` registers memory it maps itself; a shared segment is mapped by
`offload.sharing.segment`, and followers map it ``PROT_READ``: CUDA can only lock such a
range with ``cudaHostRegisterReadOnly`` (the device promises not to write it). So the
register call takes flags here. Each slot is registered on its own, in pieces of at most
`PIECE_BYTES` (one huge registration can fail and leave a sticky error), at page-aligned
offsets (`offload.pure.sharing.plan.lay_out` with the page size), so no page is registered
twice. Before a follower registers, it asks the device whether it takes read-only
registrations at all (``cudaDevAttrHostRegisterReadOnlySupported``); where it does not,
nothing is attempted and the copy stays pageable. The calls are injected (`PinCalls`),
so tests can play and fail them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import attrs
import torch

from offload.logs import logger
from offload.runtime.hostmem import PIECE_BYTES, HostRegisterError, Unregister

__all__ = [
    "ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED",
    "HOST_REGISTER_DEFAULT",
    "HOST_REGISTER_FOLLOWER",
    "HOST_REGISTER_MAPPED",
    "HOST_REGISTER_PORTABLE",
    "HOST_REGISTER_READ_ONLY",
    "PinCalls",
    "ReadOnlySupported",
    "RegisterWithFlags",
    "cuda_pin_calls",
    "register_range",
    "unregister_pieces",
]

log = logger("offload.sharing")

#: cudaHostRegisterDefault: what `offload.runtime.cudart` registers with (the leader's
#: read-write mapping).
HOST_REGISTER_DEFAULT = 0x00
#: cudaHostRegisterReadOnly: the device only reads the range; needed for memory mapped
#: ``PROT_READ`` (followers). Devices without cudaDevAttrHostRegisterReadOnlySupported
#: refuse it, and the copy then stays pageable (counted as a pin fallback).
HOST_REGISTER_READ_ONLY = 0x08
#: cudaHostRegisterPortable and cudaHostRegisterMapped: the CUDA documentation promises a
#: range "mapped and portable" under unified addressing for the default flags only, so
#: followers ask for both explicitly beside read-only (their copies are read through the
#: host pointer by zero-copy views).
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
#: What followers register their read-only mapping with.
HOST_REGISTER_FOLLOWER = HOST_REGISTER_READ_ONLY | HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE

#: cudaDevAttrHostRegisterReadOnlySupported, the ``cudaDeviceAttr`` saying whether the
#: device takes `HOST_REGISTER_READ_ONLY` (``driver_types.h`` since CUDA 11.1:
#: "Device supports using the cudaHostRegister flag cudaHostRegisterReadOnly to register
#: memory that must be mapped as read-only to the GPU"; the driver's
#: CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED has the same number).
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113

#: ``(pointer, nbytes, flags) -> cudaError`` (0 for success): ``cudaHostRegister``.
RegisterWithFlags = Callable[[int, int, int], int]
#: ``() -> value``: `ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED` of the device (0: it refuses
#: read-only registrations), or None when it cannot be read (registration is then tried).
ReadOnlySupported = Callable[[], int | None]


def _not_asked() -> int | None:
    return None


@attrs.frozen
class PinCalls:
    """``cudaHostRegister`` with flags and ``cudaHostUnregister``, each returning a cudaError,
    and the device's answer to whether it takes read-only registrations (None: unknown, so
    it is tried; fakes that leave it out are such a device)."""

    register: RegisterWithFlags
    unregister: Unregister
    read_only_supported: ReadOnlySupported = attrs.field(default=_not_asked, kw_only=True)


def cuda_pin_calls(device: torch.device) -> PinCalls:
    """The real calls for CUDA `device`, made with it current; a failed call's error is
    cleared (as `offload.runtime.cudart.host_calls` does) so that a fallback stays one.
    ``cudaDeviceGetAttribute`` is not bound by torch: it comes through ctypes from the
    libcudart torch loaded, as `offload.runtime.cudart` takes ``cudaHostAlloc``."""
    from offload.runtime.cudart import _function, _libcudart

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
    lib = _libcudart()
    last_error = _function(lib, "cudaGetLastError", ())
    get_attribute = _function(lib, "cudaDeviceGetAttribute", (ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                                              ctypes.c_int))

    def checked(status: int) -> int:
        if status and last_error is not None:
            last_error()
        return status

    def register(pointer: int, nbytes: int, flags: int) -> int:
        with torch.cuda.device(device):
            return checked(int(cudart.cudaHostRegister(pointer, nbytes, flags)))

    def unregister(pointer: int) -> int:
        with torch.cuda.device(device):
            return checked(int(cudart.cudaHostUnregister(pointer)))

    def read_only_supported() -> int | None:
        if get_attribute is None:
            log.debug("no cudaDeviceGetAttribute in libcudart: read-only registration is tried without asking")
            return None
        value = ctypes.c_int(0)
        with torch.cuda.device(device):
            index = torch.cuda.current_device()  # `device`'s, or the current one where it names none
            status = checked(int(get_attribute(ctypes.byref(value), ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, index)))
        if status != 0:
            log.debug("cudaDeviceGetAttribute(cudaDevAttrHostRegisterReadOnlySupported) failed with cudaError %d: "
                      "read-only registration is tried without knowing", status)
            return None
        return int(value.value)

    return PinCalls(register=register, unregister=unregister, read_only_supported=read_only_supported)


def register_range(calls: PinCalls, base: int, nbytes: int, flags: int,
                   piece_bytes: int = PIECE_BYTES) -> tuple[tuple[int, int], ...]:
    """Register ``[base, base + nbytes)`` in pieces of at most `piece_bytes`.

    Returns:
        (pointer, bytes) of each piece, in address order.

    Raises:
        HostRegisterError: a piece was refused; the pieces before it are unregistered.
    """
    done: list[tuple[int, int]] = []
    for offset in range(0, nbytes, piece_bytes):
        length = min(piece_bytes, nbytes - offset)
        status = calls.register(base + offset, length, flags)
        if status != 0:
            unregister_pieces(calls, tuple(done))
            raise HostRegisterError(f"cudaHostRegister (flags {flags:#x}) of {length} bytes at offset {offset} of "
                                    f"{nbytes} failed with cudaError {status}")
        done.append((base + offset, length))
    return tuple(done)


def unregister_pieces(calls: PinCalls, pieces: tuple[tuple[int, int], ...]) -> list[int]:
    """Unregister `pieces`, last first. Returns the cudaErrors of the calls that failed."""
    return [status for pointer, _ in reversed(pieces) if (status := calls.unregister(pointer)) != 0]
