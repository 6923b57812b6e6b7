"""The platform probe, with sample /proc texts and fake CUDA devices (no patching)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from offload.capture import (
    ATTR_CAN_MAP_HOST_MEMORY,
    ATTR_HOST_POINTER_FOR_REGISTERED_MEM,
    ATTR_HOST_REGISTER_SUPPORTED,
    ATTR_PAGEABLE_MEMORY_ACCESS,
    ATTR_PAGEABLE_USES_HOST_PAGE_TABLES,
    DeviceInfo,
    ProbeError,
    ReadText,
    TorchCudaProbe,
    capture_env,
    probe_platform,
    read_proc_text,
    torch_cuda_probe,
)
from offload.errors import EnvError
from offload.pure.env.snapshot import Platform

GiB = 1024**3

MEMINFO = "MemTotal:       2113929216 kB\nMemFree:        1900000000 kB\nMemAvailable:   2000000000 kB\n"
LIMITS_UNLIMITED = (
    "Limit                     Soft Limit           Hard Limit           Units     \n"
    "Max locked memory         unlimited            unlimited            bytes     \n"
)
LIMITS_64K = (
    "Limit                     Soft Limit           Hard Limit           Units     \n"
    "Max locked memory         65536                65536                bytes     \n"
)
LINUX = "6.8.0-1015-nvidia-64k\n"
WSL2 = "5.15.167.4-microsoft-standard-WSL2\n"

PROC: Mapping[str, str] = {
    "/proc/meminfo": MEMINFO,
    "/proc/self/limits": LIMITS_UNLIMITED,
    "/proc/sys/kernel/osrelease": LINUX,
    "/proc/version": f"Linux version {LINUX.strip()} (buildd@host) (gcc 13.2.0) #1 SMP",
}


def proc(**changes: str | None) -> ReadText:
    """A /proc reader over `PROC`; keyword ``meminfo="..."`` replaces /proc/meminfo, None removes it."""
    paths = {
        "meminfo": "/proc/meminfo",
        "limits": "/proc/self/limits",
        "osrelease": "/proc/sys/kernel/osrelease",
        "version": "/proc/version",
        "maps": "/proc/self/maps",
    }
    files = dict(PROC)
    for key, text in changes.items():
        if text is None:
            files.pop(paths[key], None)
        else:
            files[paths[key]] = text
    return files.get


@attrs.frozen(kw_only=True)
class FakeCuda:
    """A `CudaProbe` answering from fixed values; unknown attributes raise `ProbeError`."""

    info: DeviceInfo | None
    attributes: Mapping[int, int]
    failure: str = "libcudart is not mapped into this process (/proc/self/maps)"

    def device(self) -> DeviceInfo:
        if self.info is None:
            raise ProbeError("torch.cuda.get_device_properties(0) failed: CUDA error: no CUDA-capable device")
        return self.info

    def attribute(self, code: int) -> int:
        if code not in self.attributes:
            raise ProbeError(self.failure)
        return self.attributes[code]


H200_INFO = DeviceInfo(name="NVIDIA H200", total_bytes=150_754_820_096, major=9, minor=0, is_integrated=False)
# FACTS.md, measured on an H200: 88 = 0, 100 = 0, 19 = 1, 99 = 1. 91 is not in FACTS.md;
# CUDA documents it as 1 wherever registered memory is read at the host address (x86).
H200 = FakeCuda(
    info=H200_INFO,
    attributes={
        ATTR_PAGEABLE_MEMORY_ACCESS: 0,
        ATTR_PAGEABLE_USES_HOST_PAGE_TABLES: 0,
        ATTR_CAN_MAP_HOST_MEMORY: 1,
        ATTR_HOST_REGISTER_SUPPORTED: 1,
        ATTR_HOST_POINTER_FOR_REGISTERED_MEM: 1,
    },
)
# Hardware-coherent unified memory: same compute capability as H100/H200, told apart by 88 and 100.
GH200 = FakeCuda(
    info=DeviceInfo(name="NVIDIA GH200 480GB", total_bytes=102_005_473_280, major=9, minor=0, is_integrated=False),
    attributes={
        ATTR_PAGEABLE_MEMORY_ACCESS: 1,
        ATTR_PAGEABLE_USES_HOST_PAGE_TABLES: 1,
        ATTR_CAN_MAP_HOST_MEMORY: 1,
        ATTR_HOST_REGISTER_SUPPORTED: 1,
        ATTR_HOST_POINTER_FOR_REGISTERED_MEM: 1,
    },
)


def test_h200_is_described_from_properties_attributes_and_proc() -> None:
    platform = probe_platform(proc(), H200, torch_version="2.11.0+cu130")
    assert platform == Platform(
        has_cuda=True,
        device_name="NVIDIA H200",
        device_total_bytes=150_754_820_096,
        compute_capability="9.0",
        is_integrated=False,
        pageable_memory_access=False,
        pageable_uses_host_page_tables=False,
        can_map_host_memory=True,
        can_register_host_memory=True,
        host_pointer_for_registered_memory=True,
        is_wsl=False,
        memlock_limit_bytes=None,
        host_total_bytes=2113929216 * 1024,
        host_available_bytes=2000000000 * 1024,
        torch_version="2.11.0+cu130",
        probe_notes=(),
    )
    assert not platform.is_coherent_unified_memory


def test_gh200_is_coherent_unified_memory() -> None:
    platform = probe_platform(proc(), GH200, torch_version="2.11.0+cu130")
    assert platform.compute_capability == "9.0"
    assert platform.pageable_memory_access
    assert platform.pageable_uses_host_page_tables
    assert platform.is_coherent_unified_memory
    assert platform.probe_notes == ()


def test_integrated_gpu_is_reported() -> None:
    jetson = attrs.evolve(
        H200, info=DeviceInfo(name="Orin", total_bytes=64 * GiB, major=8, minor=7, is_integrated=True)
    )
    platform = probe_platform(proc(), jetson)
    assert platform.is_integrated
    assert platform.compute_capability == "8.7"


def test_unreadable_attributes_are_assumed_zero_with_one_note_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="offload.env")
    no_cudart = FakeCuda(info=H200_INFO, attributes={})
    platform = probe_platform(proc(), no_cudart)
    assert platform.has_cuda
    assert platform.device_name == "NVIDIA H200"
    assert (
        platform.pageable_memory_access,
        platform.pageable_uses_host_page_tables,
        platform.can_map_host_memory,
        platform.can_register_host_memory,
        platform.host_pointer_for_registered_memory,
    ) == (False, False, False, False, False)
    assert platform.probe_notes == (
        "could not read cudaDevAttrPageableMemoryAccess (88), "
        "cudaDevAttrPageableMemoryAccessUsesHostPageTables (100), cudaDevAttrCanMapHostMemory (19), "
        "cudaDevAttrHostRegisterSupported (99), cudaDevAttrCanUseHostPointerForRegisteredMem (91): "
        "libcudart is not mapped into this process (/proc/self/maps); assumed 0",
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"platform probe: {platform.probe_notes[0]}"]


def test_real_attribute_reader_without_libcudart_in_maps_gives_notes() -> None:
    """The real ctypes reader, given maps of a process without CUDA, fails softly."""
    maps = "55d1c9a4b000-55d1c9a4d000 r--p 00000000 fe:00 260386   /usr/bin/python3.11\n"

    @attrs.frozen
    class RealAttributes:
        reader: TorchCudaProbe

        def device(self) -> DeviceInfo:
            return H200_INFO

        def attribute(self, code: int) -> int:
            return self.reader.attribute(code)

    platform = probe_platform(proc(maps=maps), RealAttributes(TorchCudaProbe(proc(maps=maps))))
    assert platform.has_cuda
    assert not platform.can_map_host_memory
    assert len(platform.probe_notes) == 1
    assert "libcudart is not mapped into this process" in platform.probe_notes[0]
    assert platform.probe_notes[0].endswith("assumed 0")


@pytest.mark.parametrize(
    ("maps", "message"),
    [
        pytest.param(None, "cannot read /proc/self/maps", id="no-maps"),
        pytest.param("", "libcudart is not mapped", id="not-mapped"),
        pytest.param(
            "7f8a40000000-7f8a40090000 r-xp 00000000 fe:00 1 /nonexistent/lib/libcudart.so.12\n",
            "cannot open /nonexistent/lib/libcudart.so.12",
            id="not-loadable",
        ),
    ],
)
def test_torch_cuda_probe_attribute_failures_are_probe_errors(maps: str | None, message: str) -> None:
    probe = TorchCudaProbe(proc(maps=maps))
    with pytest.raises(ProbeError, match=message):
        probe.attribute(ATTR_CAN_MAP_HOST_MEMORY)


def test_unreadable_device_means_no_accelerator() -> None:
    platform = probe_platform(proc(), FakeCuda(info=None, attributes={}))
    assert not platform.has_cuda
    assert platform.device_name == "cpu"
    assert platform.device_total_bytes == 0
    assert len(platform.probe_notes) == 1
    assert platform.probe_notes[0].startswith("CUDA is available but device 0 could not be read")
    assert platform.probe_notes[0].endswith("assumed no accelerator")


def test_torch_without_is_integrated_is_assumed_discrete() -> None:
    old_torch = attrs.evolve(H200, info=attrs.evolve(H200_INFO, is_integrated=None))
    platform = probe_platform(proc(), old_torch)
    assert not platform.is_integrated
    assert platform.probe_notes == ("this torch does not report is_integrated; assumed a discrete GPU",)


@pytest.mark.parametrize(
    ("osrelease", "version", "is_wsl", "notes"),
    [
        pytest.param(WSL2, None, True, (), id="wsl2"),
        pytest.param("4.4.0-19041-Microsoft\n", None, True, (), id="wsl1"),
        pytest.param(LINUX, WSL2, False, (), id="osrelease-wins"),
        pytest.param(None, "Linux version 5.15.90.1-microsoft-standard-WSL2 (oe-user@oe-host)", True, (),
                     id="falls-back-to-version"),
        pytest.param(None, None, False,
                     ("could not read /proc/sys/kernel/osrelease or /proc/version; assumed not WSL",),
                     id="neither"),
    ],
)
def test_wsl(osrelease: str | None, version: str | None, is_wsl: bool, notes: tuple[str, ...]) -> None:
    platform = probe_platform(proc(osrelease=osrelease, version=version), H200)
    assert platform.is_wsl is is_wsl
    assert platform.probe_notes == notes


@pytest.mark.parametrize(
    ("limits", "expected", "notes"),
    [
        pytest.param(LIMITS_UNLIMITED, None, (), id="unlimited"),
        pytest.param(LIMITS_64K, 65536, (), id="64KiB"),
        pytest.param(None, None, ("could not read /proc/self/limits; assumed no locked-memory limit",), id="missing"),
        pytest.param("Max cpu time unlimited unlimited seconds\n", None,
                     ("/proc/self/limits: no 'Max locked memory' line in the limits text; "
                      "assumed no locked-memory limit",),
                     id="no-line"),
    ],
)
def test_memlock(limits: str | None, expected: int | None, notes: tuple[str, ...]) -> None:
    platform = probe_platform(proc(limits=limits), H200)
    assert platform.memlock_limit_bytes == expected
    assert platform.probe_notes == notes


def test_meminfo_without_memavailable_leaves_it_unknown() -> None:
    platform = probe_platform(proc(meminfo="MemTotal: 8054304 kB\nMemFree: 1234567 kB\n"), H200)
    assert platform.host_total_bytes == 8054304 * 1024
    assert platform.host_available_bytes is None
    assert platform.probe_notes == ("no MemAvailable in /proc/meminfo; available host memory unknown, not checked",)


def test_no_proc_and_no_cuda_gives_defaults_and_notes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="offload.env")
    no_files: dict[str, str] = {}
    platform = probe_platform(no_files.get, None, torch_version="2.13.0+cpu")
    assert attrs.evolve(platform, probe_notes=()) == Platform(torch_version="2.13.0+cpu")
    assert platform.probe_notes == (
        "could not read /proc/sys/kernel/osrelease or /proc/version; assumed not WSL",
        "could not read /proc/self/limits; assumed no locked-memory limit",
        "could not read /proc/meminfo; host memory unknown, not checked",
    )
    # Without a GPU none of this matters much: logged at debug, not as warnings.
    probe_records = [r for r in caplog.records if r.getMessage().startswith("platform probe:")]
    assert [r.levelno for r in probe_records] == [logging.DEBUG] * 3


def test_read_proc_text(tmp_path: Path) -> None:
    sample = tmp_path / "meminfo"
    sample.write_bytes(b"MemTotal: 1 kB\n\xff\n")
    assert read_proc_text(str(sample)) == "MemTotal: 1 kB\n\ufffd\n"
    assert read_proc_text(str(tmp_path / "missing")) is None
    assert read_proc_text(str(tmp_path)) is None  # a directory


def test_capture_env_on_this_cpu_machine() -> None:
    assert not torch.cuda.is_available()
    assert torch_cuda_probe() is None
    env = capture_env({})
    assert not env.flags.disable_pin_memory
    assert not env.flags.disable_uva
    assert not env.platform.has_cuda
    assert env.platform.device_name == "cpu"
    assert env.platform.torch_version == torch.__version__
    assert env.platform.host_available_bytes is not None
    assert env.platform.host_available_bytes > 0
    assert env.platform.host_total_bytes is not None
    assert env.platform.host_total_bytes >= env.platform.host_available_bytes
    assert env.platform.probe_notes == ()


def test_capture_env_reads_the_switches_it_is_given() -> None:
    env = capture_env({"OFFLOAD_DISABLE_PIN_MEMORY": " Yes ", "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA": "1"})
    assert env.flags.disable_pin_memory
    assert env.flags.disable_uva


def test_capture_env_rejects_a_junk_switch_naming_it() -> None:
    with pytest.raises(EnvError, match="OFFLOAD_DISABLE_UVA='maybe'") as caught:
        capture_env({"OFFLOAD_DISABLE_UVA": "maybe"})
    assert caught.value.name == "OFFLOAD_DISABLE_UVA"
    assert caught.value.value == "maybe"


class CFunction:
    """A Python callable that takes ``argtypes`` and ``restype`` as a ctypes function does."""

    def __init__(self, body: Callable[..., int]) -> None:
        self.body = body
        self.argtypes: tuple[type, ...] | None = None
        self.restype: type | None = None

    def __call__(self, *args: Any) -> int:
        return self.body(*args)


class FakeLibcudart:
    """A stand-in for libcudart: ``cudaDeviceGetAttribute`` fails for codes in `failing`
    (leaving a sticky "last error" as CUDA does) and answers 1 otherwise;
    ``cudaGetLastError`` returns and clears that error."""

    _name = "fake-libcudart.so"

    def __init__(self, failing: frozenset[int]) -> None:
        self.failing = failing
        self.last_error = 0
        self.cleared: list[int] = []
        self.cudaDeviceGetAttribute = CFunction(self._get_attribute)  # noqa: N815  # CUDA's name
        self.cudaGetLastError = CFunction(self._get_last_error)  # noqa: N815  # CUDA's name

    def _get_attribute(self, value: Any, code: int, device: int) -> int:
        if code in self.failing:
            self.last_error = 1  # cudaErrorInvalidValue
            return 1
        value._obj.value = 1
        return 0

    def _get_last_error(self) -> int:
        error, self.last_error = self.last_error, 0
        self.cleared.append(error)
        return error


def test_a_failed_attribute_read_clears_cudas_last_error() -> None:
    """Before the fix the error stayed set, for torch to report at the next kernel launch."""
    library = FakeLibcudart(frozenset({ATTR_PAGEABLE_USES_HOST_PAGE_TABLES}))
    probe = TorchCudaProbe(proc(), open_library=lambda _read: library)
    assert probe.attribute(ATTR_CAN_MAP_HOST_MEMORY) == 1
    assert library.cleared == []  # nothing to clear after a success
    with pytest.raises(ProbeError, match="cudaError 1"):
        probe.attribute(ATTR_PAGEABLE_USES_HOST_PAGE_TABLES)
    assert library.last_error == 0
    assert library.cleared == [1]


def test_a_library_without_cuda_get_last_error_still_reads_attributes() -> None:
    class Minimal:
        _name = "minimal.so"

        def __init__(self) -> None:
            self.cudaDeviceGetAttribute = CFunction(lambda value, code, device: 2)  # noqa: N815  # CUDA's name

    probe = TorchCudaProbe(proc(), open_library=lambda _read: Minimal())
    with pytest.raises(ProbeError, match="cudaError 2"):
        probe.attribute(ATTR_CAN_MAP_HOST_MEMORY)


def test_without_a_gpu_device_file_the_probe_does_not_need_torch() -> None:
    from offload.capture.device import GPU_DEVICE_FILES, gpu_may_be_present

    assert not gpu_may_be_present(lambda path: False)
    for path in GPU_DEVICE_FILES:
        assert gpu_may_be_present(lambda p, path=path: p == path)  # type: ignore[misc]


def test_capture_in_a_fresh_process_without_a_gpu_imports_no_torch() -> None:
    import subprocess
    import sys

    from offload.capture.device import gpu_may_be_present

    code = ("import sys; from offload.capture import capture_env; env = capture_env(); "
            "print(env.platform.has_cuda, 'torch' in sys.modules, env.platform.torch_version)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    has_cuda, imported, version = done.stdout.split()
    import torch

    assert version == torch.__version__
    if not gpu_may_be_present():
        assert (has_cuda, imported) == ("False", "False")
    else:
        assert imported == "True"
