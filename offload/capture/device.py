"""Reading the compute device: torch for its properties, ``cudaDeviceGetAttribute``
through ctypes on the libcudart torch loaded for its attributes (`TorchCudaProbe`), behind
the `CudaProbe` protocol that tests fake; `probe_device` turns what it reads into the
platform's device fields, each unreadable value a safe assumption with a note."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any, Protocol, final

import attrs

from offload.capture.proc import MAPS_PATH, ReadText, read_proc_text
from offload.logs import logger
from offload.pure.env.procfs import find_libcudart

__all__ = [
    "ATTR_CAN_MAP_HOST_MEMORY",
    "ATTR_HOST_POINTER_FOR_REGISTERED_MEM",
    "ATTR_HOST_REGISTER_SUPPORTED",
    "ATTR_PAGEABLE_MEMORY_ACCESS",
    "ATTR_PAGEABLE_USES_HOST_PAGE_TABLES",
    "CudaProbe",
    "DeviceFields",
    "DeviceInfo",
    "ProbeError",
    "TorchCudaProbe",
    "open_libcudart",
    "probe_device",
    "GPU_DEVICE_FILES",
    "gpu_may_be_present",
    "torch_cuda_probe",
]

_log = logger("offload.env")

# cudaDeviceAttr values from the CUDA runtime API (driver_types.h); see FACTS.md.
ATTR_CAN_MAP_HOST_MEMORY = 19
ATTR_PAGEABLE_MEMORY_ACCESS = 88
ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_PAGEABLE_USES_HOST_PAGE_TABLES = 100

# The device every plan is made for: torch's cuda:0 (after CUDA_VISIBLE_DEVICES).
_DEVICE_INDEX = 0


class ProbeError(Exception):
    """A `CudaProbe` could not read a value; the message says why.

    Internal to the probe: `probe_platform` turns it into an assumption and a note, so it
    never reaches a user.
    """


@attrs.frozen(kw_only=True)
class DeviceInfo:
    """What torch reports about the compute device.

    Attributes:
        name: the device name (``NVIDIA H200``).
        total_bytes: total device memory, in bytes.
        major: compute capability, major part.
        minor: compute capability, minor part.
        is_integrated: the GPU shares one memory pool with the host; None when this torch
            does not report it.
    """

    name: str
    total_bytes: int
    major: int
    minor: int
    is_integrated: bool | None


class CudaProbe(Protocol):
    """Reads the compute device; the real one is `TorchCudaProbe`, tests pass fakes."""

    def device(self) -> DeviceInfo:
        """The device's properties.

        Raises:
            ProbeError: they cannot be read.
        """
        ...

    def attribute(self, code: int) -> int:
        """The value of ``cudaDeviceGetAttribute(code)`` for the device.

        Args:
            code: a ``cudaDeviceAttr`` value (e.g. `ATTR_PAGEABLE_MEMORY_ACCESS`).

        Raises:
            ProbeError: it cannot be read (no libcudart, symbol missing, CUDA error).
        """
        ...


# Each attribute we read: its code, its cudaDeviceAttr name, and the Platform field it
# fills. An unreadable attribute is assumed 0 (False): that turns off coherent-memory
# handling, UVA and in-place registration, each of which has a working fallback.
_ATTRIBUTES: tuple[tuple[int, str, str], ...] = (
    (ATTR_PAGEABLE_MEMORY_ACCESS, "cudaDevAttrPageableMemoryAccess", "pageable_memory_access"),
    (
        ATTR_PAGEABLE_USES_HOST_PAGE_TABLES,
        "cudaDevAttrPageableMemoryAccessUsesHostPageTables",
        "pageable_uses_host_page_tables",
    ),
    (ATTR_CAN_MAP_HOST_MEMORY, "cudaDevAttrCanMapHostMemory", "can_map_host_memory"),
    (ATTR_HOST_REGISTER_SUPPORTED, "cudaDevAttrHostRegisterSupported", "can_register_host_memory"),
    (
        ATTR_HOST_POINTER_FOR_REGISTERED_MEM,
        "cudaDevAttrCanUseHostPointerForRegisteredMem",
        "host_pointer_for_registered_memory",
    ),
)


@attrs.frozen(kw_only=True)
class DeviceFields:
    """The platform's device fields, as `probe_device` read them."""

    has_cuda: bool = False
    device_name: str = "cpu"
    device_total_bytes: int = 0
    compute_capability: str = ""
    is_integrated: bool = False
    pageable_memory_access: bool = False
    pageable_uses_host_page_tables: bool = False
    can_map_host_memory: bool = False
    can_register_host_memory: bool = False
    host_pointer_for_registered_memory: bool = False


def probe_device(cuda: CudaProbe | None, notes: list[str]) -> DeviceFields:
    if cuda is None:
        _log.debug("no CUDA device (torch.cuda.is_available() is False); the compute device is the CPU")
        return DeviceFields()
    try:
        info = cuda.device()
    except ProbeError as exc:
        notes.append(f"CUDA is available but device {_DEVICE_INDEX} could not be read ({exc}); "
                     "assumed no accelerator")
        return DeviceFields()
    if info.is_integrated is None:
        notes.append("this torch does not report is_integrated; assumed a discrete GPU")
    values: dict[str, bool] = {}
    failures: dict[str, list[str]] = {}
    for code, attr_name, field in _ATTRIBUTES:
        try:
            values[field] = cuda.attribute(code) != 0
        except ProbeError as exc:
            values[field] = False
            failures.setdefault(str(exc), []).append(f"{attr_name} ({code})")
    for reason, names in failures.items():
        notes.append(f"could not read {', '.join(names)}: {reason}; assumed 0")
    return DeviceFields(
        has_cuda=True,
        device_name=info.name,
        device_total_bytes=info.total_bytes,
        compute_capability=f"{info.major}.{info.minor}",
        is_integrated=bool(info.is_integrated),
        pageable_memory_access=values["pageable_memory_access"],
        pageable_uses_host_page_tables=values["pageable_uses_host_page_tables"],
        can_map_host_memory=values["can_map_host_memory"],
        can_register_host_memory=values["can_register_host_memory"],
        host_pointer_for_registered_memory=values["host_pointer_for_registered_memory"],
    )


@final
class TorchCudaProbe:
    """The real `CudaProbe`: torch for device properties, ctypes for attributes.

    Attributes are read with ``cudaDeviceGetAttribute`` from the libcudart already mapped
    into this process (found in /proc/self/maps when first needed), opened with
    ``RTLD_NOLOAD`` so that a second, different CUDA runtime is never loaded.

    A failed ``cudaDeviceGetAttribute`` leaves its error as CUDA's "last error", which torch
    would report at the next kernel launch, far from here: it is cleared at once with
    ``cudaGetLastError`` from the same library.

    Args:
        read_text: reads /proc/self/maps.
        device_index: the torch CUDA device index.
        open_library: opens the CUDA runtime (`open_libcudart`); tests pass a fake with
            ``cudaDeviceGetAttribute`` and ``cudaGetLastError``.
    """

    def __init__(self, read_text: ReadText, device_index: int = _DEVICE_INDEX, *,
                 open_library: Callable[[ReadText], Any] | None = None) -> None:
        self._read_text = read_text
        self._index = device_index
        self._open_library: Callable[[ReadText], Any] = open_library or open_libcudart
        self._get_attribute: Callable[..., Any] | None = None
        self._get_last_error: Callable[[], Any] | None = None

    def device(self) -> DeviceInfo:
        """The device's properties, from ``torch.cuda.get_device_properties``.

        Raises:
            ProbeError: torch could not initialise CUDA or read the device.
        """
        import torch

        try:
            props = torch.cuda.get_device_properties(self._index)
        except (RuntimeError, AssertionError) as exc:  # torch raises both for a broken CUDA
            raise ProbeError(f"torch.cuda.get_device_properties({self._index}) failed: {exc}") from exc
        integrated = getattr(props, "is_integrated", None)  # added in torch 2.x; absent before
        return DeviceInfo(
            name=str(props.name),
            total_bytes=int(props.total_memory),
            major=int(props.major),
            minor=int(props.minor),
            is_integrated=None if integrated is None else bool(integrated),
        )

    def attribute(self, code: int) -> int:
        """``cudaDeviceGetAttribute(code)`` for the device.

        Args:
            code: a ``cudaDeviceAttr`` value.

        Returns:
            The attribute's value.

        Raises:
            ProbeError: libcudart is not mapped, cannot be opened or lacks the symbol, or
                the call returned a CUDA error.
        """
        get_attribute = self._function()
        value = ctypes.c_int(0)
        status = int(get_attribute(ctypes.byref(value), code, self._index))
        if status != 0:
            if self._get_last_error is not None:
                self._get_last_error()  # clears the error (returns it too)
            raise ProbeError(f"cudaDeviceGetAttribute returned cudaError {status}")
        return value.value

    def _function(self) -> Callable[..., Any]:
        if self._get_attribute is not None:
            return self._get_attribute
        library = self._open_library(self._read_text)
        name = getattr(library, "_name", "libcudart")
        try:
            function = library.cudaDeviceGetAttribute
        except AttributeError as exc:
            raise ProbeError(f"cannot use cudaDeviceGetAttribute from {name}: {exc}") from exc
        function.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        function.restype = ctypes.c_int
        last_error = getattr(library, "cudaGetLastError", None)
        if last_error is not None:
            last_error.argtypes = ()
            last_error.restype = ctypes.c_int
        else:
            _log.debug("%s has no cudaGetLastError: errors of failed attribute reads are not cleared", name)
        _log.debug("reading device attributes through %s", name)
        self._get_last_error = last_error
        self._get_attribute = function
        return self._get_attribute


def open_libcudart(read_text: ReadText = read_proc_text) -> ctypes.CDLL:
    """The CUDA runtime library torch has loaded, found in /proc/self/maps (preferring the
    version torch was built with) and opened with ``RTLD_NOLOAD``, so that a second,
    different CUDA runtime is never loaded.

    Raises:
        ProbeError: maps cannot be read, no libcudart is mapped, or it cannot be opened.
    """
    maps = read_text(MAPS_PATH)
    if maps is None:
        raise ProbeError(f"cannot read {MAPS_PATH} to find libcudart")
    import torch

    built_with = torch.version.cuda  # "13.0" on CUDA builds, None on others
    path = find_libcudart(maps, str(built_with).split(".")[0] if built_with else None)
    if path is None:
        raise ProbeError(f"libcudart is not mapped into this process ({MAPS_PATH})")
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError as exc:
        raise ProbeError(f"cannot open {path}: {exc}") from exc


def torch_cuda_probe(read_text: ReadText = read_proc_text) -> CudaProbe | None:
    """The real device probe, or None when torch sees no CUDA device.

    Args:
        read_text: reads /proc/self/maps when attributes are first asked for.

    Returns:
        A `TorchCudaProbe` for ``cuda:0``, or None.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    return TorchCudaProbe(read_text)


#: Device files one of which a GPU torch can use makes: NVIDIA's driver (``/dev/nvidiactl``,
#: in containers too), WSL's GPU paravirtualisation (``/dev/dxg``), ROCm's (``/dev/kfd``).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/dxg", "/dev/kfd")


def gpu_may_be_present(exists: Callable[[str], bool] = os.path.exists) -> bool:
    """Whether any of `GPU_DEVICE_FILES` exists: without one, torch can see no GPU, and
    the probe need not import torch (seconds) to find none."""
    return any(exists(path) for path in GPU_DEVICE_FILES)
