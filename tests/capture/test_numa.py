"""The NUMA probe (offload.capture.numa) over fake sysfs trees in a temporary directory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from offload.capture import capture_env
from offload.capture.numa import NODE_ONLINE, PCI_NUMA_NODE, probe_numa, torch_gpu_bus_id, with_numa_topology
from offload.pure.env.numa import NumaTopology
from offload.pure.env.snapshot import Platform

BUS = "0000:17:00.0"
GPU = Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=1 << 30)


def sysfs(root: Path, *, online: str | None = "0-1\n", numa_node: str | None = "1\n", bus: str = BUS) -> Path:
    """A fake sysfs under `root`: the online node list and one PCI device's numa_node."""
    if online is not None:
        path = root / NODE_ONLINE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(online)
    if numa_node is not None:
        path = root / PCI_NUMA_NODE.format(bus_id=bus)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(numa_node)
    return root


def test_gpu_on_node_1_of_2(tmp_path: Path) -> None:
    assert probe_numa(sysfs(tmp_path), bus_id=BUS) == (NumaTopology(nodes=(0, 1), gpu_node=1), ())


@pytest.mark.parametrize("spelling", ["00000000:17:00.0", "0000:17:00.0", "17:00.0"])
def test_cuda_spellings_of_the_bus_id_find_the_sysfs_device(tmp_path: Path, spelling: str) -> None:
    topology, notes = probe_numa(sysfs(tmp_path), bus_id=spelling)
    assert (topology.gpu_node, notes) == (1, ())


def test_upper_case_bus_ids_are_lower_cased(tmp_path: Path) -> None:
    topology, _ = probe_numa(sysfs(tmp_path, bus="0000:c1:00.0"), bus_id="0000:C1:00.0")
    assert topology.gpu_node == 1


def test_no_affinity_is_no_gpu_node_without_a_note(tmp_path: Path) -> None:
    assert probe_numa(sysfs(tmp_path, online="0\n", numa_node="-1\n"), bus_id=BUS) == (NumaTopology(nodes=(0,)), ())


def test_without_a_gpu_there_is_no_gpu_node(tmp_path: Path) -> None:
    assert probe_numa(sysfs(tmp_path, online="0,2-3"), bus_id=None) == (NumaTopology(nodes=(0, 2, 3)), ())


def test_nothing_in_sysfs_is_unknown_with_notes(tmp_path: Path) -> None:
    topology, notes = probe_numa(tmp_path, bus_id=BUS)
    assert topology == NumaTopology()
    assert notes == (
        f"could not read {tmp_path / NODE_ONLINE}; NUMA nodes unknown",
        f"could not read {tmp_path / PCI_NUMA_NODE.format(bus_id=BUS)}; the GPU's NUMA node unknown",
    )


@pytest.mark.parametrize(
    ("online", "numa_node", "topology", "note"),
    [("zero", "1", NumaTopology(gpu_node=1), "is not a node number; NUMA nodes unknown"),
     ("", "1", NumaTopology(gpu_node=1), "lists no nodes; NUMA nodes unknown"),
     ("0-1", "junk", NumaTopology(nodes=(0, 1)), "is not a node number; the GPU's NUMA node unknown"),
     ("0-1", "3", NumaTopology(nodes=(0, 1)), "says node 3, which is not online (0-1)")],
)
def test_odd_sysfs_texts_are_unknown_with_a_note(tmp_path: Path, online: str, numa_node: str,
                                                 topology: NumaTopology, note: str) -> None:
    found, notes = probe_numa(sysfs(tmp_path, online=online, numa_node=numa_node), bus_id=BUS)
    assert found == topology
    assert len(notes) == 1 and note in notes[0]


def test_a_bad_bus_id_is_a_note(tmp_path: Path) -> None:
    topology, notes = probe_numa(sysfs(tmp_path), bus_id="nonsense")
    assert topology == NumaTopology(nodes=(0, 1))
    assert len(notes) == 1 and "PCI bus id 'nonsense'" in notes[0]


def test_with_numa_topology_asks_for_the_bus_id_only_with_cuda(tmp_path: Path) -> None:
    asked: list[bool] = []

    def bus_id() -> str:
        asked.append(True)
        return BUS

    cpu = with_numa_topology(Platform(), root=sysfs(tmp_path), bus_id=bus_id)
    assert asked == [] and cpu.numa == NumaTopology(nodes=(0, 1))
    gpu = with_numa_topology(GPU, root=tmp_path, bus_id=bus_id)
    assert asked == [True] and gpu.numa == NumaTopology(nodes=(0, 1), gpu_node=1)
    assert gpu.probe_notes == ()


def test_with_numa_topology_keeps_earlier_notes_and_logs_its_own(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="offload.env")

    def broken() -> str:
        raise RuntimeError("no device properties")

    platform = Platform(has_cuda=True, probe_notes=("an earlier note",))
    probed = with_numa_topology(platform, root=tmp_path, bus_id=broken)
    assert probed.numa == NumaTopology()
    assert probed.probe_notes == (
        "an earlier note",
        "could not read the GPU's PCI bus id (no device properties); the GPU's NUMA node unknown",
        f"could not read {tmp_path / NODE_ONLINE}; NUMA nodes unknown",
    )
    records = [r for r in caplog.records if r.getMessage().startswith("platform probe:")]
    assert [r.levelno for r in records] == [logging.WARNING] * 2  # a CUDA machine: warnings


def test_this_machine(tmp_path: Path) -> None:
    env = capture_env({})
    assert not env.platform.has_cuda
    assert env.platform.numa.gpu_node is None  # without CUDA: no GPU node
    if Path("/", NODE_ONLINE).exists():
        assert env.platform.numa.nodes, "sysfs lists the online nodes here"
        assert 0 in env.platform.numa.nodes


def test_torch_gpu_bus_id_without_cuda_raises() -> None:
    assert not torch.cuda.is_available()
    with pytest.raises((RuntimeError, AssertionError)):
        torch_gpu_bus_id()
