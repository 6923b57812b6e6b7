"""`Runtime` implementations: `CudaRuntime` on a GPU, `CpuRuntime` without one."""

from offload.runtime.cpu import CpuRuntime

__all__ = ["CpuRuntime"]
