"""The CUDA runtime calls behind page-locked host memory (ready to inject into `hostmem`),
and the copy stream.

``cudaHostRegister`` and ``cudaHostUnregister`` come from ``torch.cuda.cudart()``.
``cudaHostAlloc`` and ``cudaFreeHost`` are not bound by torch, and the error clearing
needs ``cudaGetLastError``: those come through ctypes from the libcudart torch loaded
(found in /proc/self/maps). Every call runs with the runtime's device current, so the
memory is associated with that device. A failed call leaves its error as CUDA's "last
error", which torch would report at the next kernel launch, far from here; it is cleared
so that a fallback stays a fallback.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import attrs
import torch

from offload.capture.device import ProbeError, open_libcudart
from offload.capture.proc import MAPS_PATH
from offload.logs import logger
from offload.runtime.hostmem import Alloc, Free, HostRegisterError, Register, Unregister

__all__ = ["HOST_ALLOC_FLAGS", "HostCalls", "copy_stream", "host_calls", "relax_capture_mode"]

log = logger("offload.host")

#: cudaHostAllocPortable | cudaHostAllocMapped: usable from every device, at the host
#: address (under unified addressing, whatever the flags, unless write-combined).
HOST_ALLOC_FLAGS = 0x01 | 0x02
#: cudaStreamNonBlocking: no implicit synchronisation with the legacy default stream.
_STREAM_NON_BLOCKING = 0x01


@attrs.frozen
class HostCalls:
    """The four calls, each returning a cudaError (0 for success); see `hostmem`."""

    register: Register
    unregister: Unregister
    alloc: Alloc
    free: Free


def _libcudart() -> ctypes.CDLL | None:
    try:
        return open_libcudart()
    except ProbeError as exc:
        log.debug("%s: no cudaHostAlloc, no dedicated copy stream, and CUDA errors of failed pinning "
                  "are not cleared", exc)
        return None


def _function(lib: ctypes.CDLL | None, name: str, argtypes: tuple[type, ...]) -> Callable[..., int] | None:
    if lib is None:
        return None
    try:
        function = getattr(lib, name)
    except AttributeError:
        log.debug("libcudart has no %s", name)
        return None
    function.restype = ctypes.c_int
    function.argtypes = argtypes
    return function  # type: ignore[no-any-return]  # a ctypes function: untyped


def host_calls(device: torch.device) -> HostCalls:
    """The calls for `device` (a CUDA device)."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
    lib = _libcudart()
    last_error = _function(lib, "cudaGetLastError", ())
    host_alloc = _function(lib, "cudaHostAlloc", (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint))
    free_host = _function(lib, "cudaFreeHost", (ctypes.c_void_p,))

    def checked(status: int) -> int:
        if status and last_error is not None:
            last_error()
        return status

    def register(pointer: int, nbytes: int) -> int:
        with torch.cuda.device(device):
            return checked(int(cudart.cudaHostRegister(pointer, nbytes, 0)))

    def unregister(pointer: int) -> int:
        with torch.cuda.device(device):
            return checked(int(cudart.cudaHostUnregister(pointer)))

    if host_alloc is not None and free_host is not None:
        allocate, release = host_alloc, free_host

        def alloc(nbytes: int) -> tuple[int, int]:
            pointer = ctypes.c_void_p()
            with torch.cuda.device(device):
                status = checked(allocate(ctypes.byref(pointer), nbytes, HOST_ALLOC_FLAGS))
            return status, pointer.value or 0

        def free(pointer: int) -> int:
            with torch.cuda.device(device):
                return checked(release(pointer))
    else:

        def alloc(nbytes: int) -> tuple[int, int]:
            raise HostRegisterError(f"cudaHostAlloc is not available (libcudart not found in {MAPS_PATH})")

        def free(pointer: int) -> int:
            return 0  # nothing was ever allocated

    return HostCalls(register=register, unregister=unregister, alloc=alloc, free=free)


# One copy stream per device for the whole process, never destroyed (a stream is small,
# and destroying one could fall inside another thread's graph capture).
_copy_streams: dict[int, torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream host-to-device copies run on, for ``cuda:index``.

    A stream of its own, made by ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` and
    shared by every runtime on the device. PyTorch's ``torch.cuda.Stream()`` hands out
    streams round-robin from a pool of 32, so copies could land on the very stream a CUDA
    graph is captured on (and run serially with the compute); where the call is
    unavailable, that pool is used anyway."""
    index = device.index  # CudaRuntime's device always has one
    with _copy_streams_lock:
        stream = _copy_streams.get(index)
        if stream is None:
            stream = _copy_streams[index] = _new_stream(torch.device("cuda", index))
        return stream


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    lib = _libcudart()
    create = _function(lib, "cudaStreamCreateWithFlags", (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint))
    if create is not None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            status = create(ctypes.byref(handle), _STREAM_NON_BLOCKING)
        if status == 0 and handle.value:
            return torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]  # unannotated in torch
        last_error = _function(lib, "cudaGetLastError", ())
        if last_error is not None:
            last_error()
        log.debug("cudaStreamCreateWithFlags failed with cudaError %d", status)
    log.debug("the copy stream for %s comes from PyTorch's stream pool", device)
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch



#: cudaStreamCaptureModeRelaxed: this thread's CUDA calls do not invalidate another
#: thread's stream capture.
_CAPTURE_MODE_RELAXED = 2


def relax_capture_mode() -> bool:
    """Put the calling thread in relaxed stream-capture mode
    (``cudaThreadExchangeStreamCaptureMode``), so that what it asks of CUDA (an event
    query) does not invalidate a CUDA graph another thread is capturing; False where the
    call is unavailable (the thread stays as it was)."""
    exchange = _function(_libcudart(), "cudaThreadExchangeStreamCaptureMode", (ctypes.POINTER(ctypes.c_int),))
    if exchange is None:
        return False
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    return exchange(ctypes.byref(mode)) == 0
