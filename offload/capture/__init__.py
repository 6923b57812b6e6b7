"""The only room of `offload` that reads the machine: ``os.environ``, the device through
``torch.cuda`` and the CUDA runtime, ``/proc`` and ``/sys`` (a test holds every other
module to that; the runtimes' own device calls are theirs).

- `env`: `capture_env`, the one snapshot of the user's switches and the platform
  (`probe_platform` over injectable readers), from `proc` (``/proc``: `read_proc_text`,
  WSL, the locked-memory limit, meminfo) and `device` (the CUDA probes).
- `cgroup`: the cgroup's memory limit (``/proc/self/cgroup``, mountinfo, ``/sys/fs/cgroup``).
- `numa`: the host's NUMA nodes and the GPU's (``/sys/devices/system/node``, PCI ``numa_node``).
- `numa_bandwidth`: host-to-device bandwidth per NUMA node, and where pages landed
  (``/proc/self/numa_maps``), for the benchmarks and diagnosis.
- `smaps`: what a shared segment takes of each process (``/proc/<pid>/smaps``).
- `host`: this boot's id (``/proc/sys/kernel/random/boot_id``), which tells hosts apart.

What is read is parsed by pure functions (`offload.pure.env.procfs`, `offload.pure.env.cgroup`,
`offload.pure.decide.numa`), so tests feed them sample texts.
"""

from offload.capture.device import (
    ATTR_CAN_MAP_HOST_MEMORY,
    ATTR_HOST_POINTER_FOR_REGISTERED_MEM,
    ATTR_HOST_REGISTER_SUPPORTED,
    ATTR_PAGEABLE_MEMORY_ACCESS,
    ATTR_PAGEABLE_USES_HOST_PAGE_TABLES,
    CudaProbe,
    DeviceInfo,
    ProbeError,
    TorchCudaProbe,
    open_libcudart,
    torch_cuda_probe,
)
from offload.capture.env import capture_env, probe_platform
from offload.capture.proc import ReadText, read_proc_text

__all__ = [
    "ATTR_CAN_MAP_HOST_MEMORY",
    "ATTR_HOST_POINTER_FOR_REGISTERED_MEM",
    "ATTR_HOST_REGISTER_SUPPORTED",
    "ATTR_PAGEABLE_MEMORY_ACCESS",
    "ATTR_PAGEABLE_USES_HOST_PAGE_TABLES",
    "CudaProbe",
    "DeviceInfo",
    "ProbeError",
    "ReadText",
    "TorchCudaProbe",
    "capture_env",
    "open_libcudart",
    "probe_platform",
    "read_proc_text",
    "torch_cuda_probe",
]
