"""Probe the host's NUMA nodes and the GPU's node from sysfs (part of `capture_env`).

Reads ``/sys/devices/system/node/online`` and the GPU's PCI device's ``numa_node``
(``/sys/bus/pci/devices/<bus id>/numa_node``, the bus id from torch's device
properties). Every path is taken under a root directory, so tests build a fake sysfs in
a temporary directory. Nothing here raises for a missing file or GPU: what cannot be read
is unknown, with one line in `Platform.probe_notes` saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs

from offload.logs import logger
from offload.pure.env.numa import (
    NumaTopology,
    format_node_list,
    normalise_pci_bus_id,
    parse_node_list,
    parse_numa_node,
    pci_bus_id,
)
from offload.pure.env.snapshot import Platform

__all__ = ["NODE_ONLINE", "PCI_NUMA_NODE", "probe_numa", "torch_gpu_bus_id", "with_numa_topology"]

_log = logger("offload.env")

#: The online node list, relative to the sysfs root's parent (``/``).
NODE_ONLINE = "sys/devices/system/node/online"
#: A PCI device's node, by its bus id (``0000:17:00.0``), relative to ``/``.
PCI_NUMA_NODE = "sys/bus/pci/devices/{bus_id}/numa_node"

#: Returns the compute GPU's PCI bus id, or raises (RuntimeError, ValueError, ...).
BusId = Callable[[], str]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        _log.debug("cannot read %s: %s", path, exc)
        return None


T = TypeVar("T")


def _read_parsed(path: Path, parse: Callable[[str], T], unknown: str, notes: list[str]) -> T | None:
    """`parse` of the file at `path`; None, with a note ending in `unknown`, when it cannot
    be read or parsed."""
    text = _read(path)
    if text is None:
        notes.append(f"could not read {path}; {unknown}")
        return None
    try:
        return parse(text)
    except ValueError as exc:
        notes.append(f"{path}: {exc}; {unknown}")
        return None


def probe_numa(root: str | Path = "/", *, bus_id: str | None) -> tuple[NumaTopology, tuple[str, ...]]:
    """The host's NUMA nodes and the GPU's, read from the sysfs under `root`.

    Args:
        root: the directory holding ``sys/`` (``/`` on a real machine).
        bus_id: the GPU's PCI bus id in any spelling CUDA or sysfs use, or None without
            a GPU (then there is no GPU node, and no note says so).

    Returns:
        The topology (unknown parts empty or None) and one note per thing that could not
        be read or made no sense.
    """
    base = Path(root)
    notes: list[str] = []
    online = base / NODE_ONLINE
    nodes = _read_parsed(online, parse_node_list, "NUMA nodes unknown", notes) or ()
    if not nodes and not notes:
        notes.append(f"{online} lists no nodes; NUMA nodes unknown")
    gpu_node: int | None = None
    if bus_id is not None:
        try:
            name = normalise_pci_bus_id(bus_id)
        except ValueError as exc:
            notes.append(f"{exc}; the GPU's NUMA node unknown")
            return NumaTopology(nodes=nodes), tuple(notes)
        path = base / PCI_NUMA_NODE.format(bus_id=name)
        gpu_node = _read_parsed(path, parse_numa_node, "the GPU's NUMA node unknown", notes)
        if gpu_node is not None and nodes and gpu_node not in nodes:
            notes.append(f"{path} says node {gpu_node}, which is not online "
                         f"({format_node_list(nodes)}); the GPU's NUMA node unknown")
            gpu_node = None
    return NumaTopology(nodes=nodes, gpu_node=gpu_node), tuple(notes)


def torch_gpu_bus_id(index: int = 0) -> str:
    """The PCI bus id of ``cuda:index`` in sysfs spelling, from torch's device properties
    (``pci_domain_id``, ``pci_bus_id``, ``pci_device_id``; a GPU is function 0).

    Raises:
        RuntimeError: torch cannot read the device, or this torch does not report them.
    """
    import torch

    props = torch.cuda.get_device_properties(index)
    try:
        domain, bus, device = (int(getattr(props, name)) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    except AttributeError as exc:
        raise RuntimeError(f"this torch does not report the device's PCI location: {exc}") from exc
    return pci_bus_id(domain, bus, device)


def with_numa_topology(platform: Platform, *, root: str | Path = "/",
                       bus_id: BusId = torch_gpu_bus_id) -> Platform:
    """`platform` with its `Platform.numa` probed and the probe's notes added.

    Args:
        platform: from `offload.capture.probe_platform`.
        root: the directory holding ``sys/``; tests pass a fake sysfs.
        bus_id: returns the GPU's PCI bus id; asked only when `platform` has CUDA. Any
            exception it raises becomes a note (the GPU's node is then unknown).

    Returns:
        The platform with the topology; notes are logged as the capture logs its own
        (warning on a CUDA machine, debug otherwise).
    """
    notes: list[str] = []
    gpu: str | None = None
    if platform.has_cuda:
        try:
            gpu = bus_id()
        except Exception as exc:  # noqa: BLE001 - a probe never fails: anything is a note
            notes.append(f"could not read the GPU's PCI bus id ({exc}); the GPU's NUMA node unknown")
    topology, found = probe_numa(root, bus_id=gpu)
    notes.extend(found)
    level = logging.WARNING if platform.has_cuda else logging.DEBUG
    for note in notes:
        _log.log(level, "platform probe: %s", note)
    return attrs.evolve(platform, numa=topology, probe_notes=(*platform.probe_notes, *notes))
