"""Capture the environment once: the user's switches and what this machine can do.

The environment variables, ``torch.cuda``'s device, and what ``/proc`` says of this process
and machine (`offload.capture` is the only room that reads the machine). It is split so
that its effects are thin and injectable:

- `probe_platform` turns what it is given into a `Platform`. It reads files only through
  the `ReadText` callable and the GPU only through a `CudaProbe`, so tests pass a dict of
  sample /proc texts and a fake device instead of patching anything.
- `read_proc_text` (`offload.capture.proc`), `TorchCudaProbe` and `torch_cuda_probe`
  (`offload.capture.device`) are the real effects: open a file, ask torch, call
  ``cudaDeviceGetAttribute`` through ctypes on the libcudart that torch loaded.
- `capture_env` wires the real effects together, and adds what `offload.capture.numa` (NUMA
  nodes) and `offload.capture.cgroup` (the cgroup's memory limit, read under a root
  directory that tests point at a fake tree) find.

Whatever cannot be read gets a safe assumption, one line in `Platform.probe_notes` saying
what was assumed, and a log message (warning on a CUDA machine, where it matters; debug
otherwise). Nothing here raises for a missing GPU, driver or /proc.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from importlib import metadata

from offload.capture.cgroup import with_cgroup_memory
from offload.capture.device import CudaProbe, gpu_may_be_present, probe_device, torch_cuda_probe
from offload.capture.numa import with_numa_topology
from offload.capture.proc import ReadText, probe_meminfo, probe_memlock, probe_wsl, read_proc_text
from offload.logs import logger
from offload.pure.env.snapshot import EnvSnapshot, Platform, parse_env

__all__ = ["capture_env", "probe_platform"]

_log = logger("offload.env")


def probe_platform(read_text: ReadText, cuda: CudaProbe | None, *, torch_version: str = "") -> Platform:
    """Describe the machine from the given readers; the pure-ish heart of `capture_env`.

    Args:
        read_text: returns a file's text by path, or None when it cannot be read; only
            /proc paths are asked for. Tests pass ``{path: text}.get``.
        cuda: the compute device, or None when there is no usable CUDA device.
        torch_version: recorded as is.

    Returns:
        The platform. Every value that could not be read is a safe assumption (no
        accelerator; attribute 0; not WSL; no locked-memory limit; host memory unknown,
        i.e. None), with one line per assumption in ``probe_notes``.

    Raises:
        Nothing for missing or unreadable inputs; only `ProbeError` is caught from `cuda`,
        so a fake that raises anything else is a bug in the fake and surfaces.
    """
    notes: list[str] = []
    device = probe_device(cuda, notes)
    is_wsl = probe_wsl(read_text, notes)
    memlock = probe_memlock(read_text, notes)
    host_total, host_available = probe_meminfo(read_text, notes)
    level = logging.WARNING if device.has_cuda else logging.DEBUG
    for note in notes:
        _log.log(level, "platform probe: %s", note)
    return Platform(
        has_cuda=device.has_cuda,
        device_name=device.device_name,
        device_total_bytes=device.device_total_bytes,
        compute_capability=device.compute_capability,
        is_integrated=device.is_integrated,
        pageable_memory_access=device.pageable_memory_access,
        pageable_uses_host_page_tables=device.pageable_uses_host_page_tables,
        can_map_host_memory=device.can_map_host_memory,
        can_register_host_memory=device.can_register_host_memory,
        host_pointer_for_registered_memory=device.host_pointer_for_registered_memory,
        is_wsl=is_wsl,
        memlock_limit_bytes=memlock,
        host_total_bytes=host_total,
        host_available_bytes=host_available,
        torch_version=torch_version,
        probe_notes=tuple(notes),
    )


def _installed_torch_version() -> str:
    """torch's version as installed (its package metadata), without importing it; the
    imported module's where torch is imported already."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def capture_env(environ: Mapping[str, str] = os.environ) -> EnvSnapshot:
    """Capture the user's switches and this machine's platform, once.

    On a CUDA machine this initialises CUDA in the calling process (as any use of the GPU
    would), so call it after forking worker processes, not before. On a machine with no GPU
    device file (`offload.capture.device.GPU_DEVICE_FILES`) torch is not imported for it.

    Args:
        environ: the environment variables; ``os.environ`` unless a caller passes its own.

    Returns:
        The snapshot every plan is made against. Values that could not be read are safe
        assumptions listed in ``platform.probe_notes``.

    Raises:
        EnvError: a switch variable holds a value that is not a switch, or two spellings
            of one switch disagree.
    """
    flags = parse_env(environ)
    if gpu_may_be_present():
        import torch

        cuda, version = torch_cuda_probe(read_proc_text), str(torch.__version__)
    else:  # no GPU device file: torch would find none; not imported for that (seconds)
        cuda, version = None, _installed_torch_version()
    platform = probe_platform(read_proc_text, cuda, torch_version=version)
    platform = with_numa_topology(platform)  # sysfs: the host's NUMA nodes and the GPU's
    platform = with_cgroup_memory(platform)  # the cgroup's memory limit, which the OOM killer enforces
    return EnvSnapshot(flags=flags, platform=platform)
