"""NUMA-local host copies on a real device: the probe finds the GPU's node, the plan picks
it (or says why not), and CudaRuntime's registered copies land on it (/proc/self/numa_maps)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from offload import capture_env, make_plan
from offload.capture.numa import PCI_NUMA_NODE, torch_gpu_bus_id
from offload.create import default_runtime
from offload.model.describe import describe_layers
from offload.pure import OffloadConfig, PinMethod
from offload.pure.env.numa import parse_numa_maps, parse_numa_node
from offload.runtime.cuda import CudaRuntime


def test_the_probe_reads_the_gpus_node_from_sysfs() -> None:
    env = capture_env(os.environ)
    path = Path("/", PCI_NUMA_NODE.format(bus_id=torch_gpu_bus_id()))
    if not path.exists():
        assert env.platform.numa.gpu_node is None
        assert any("the GPU's NUMA node unknown" in note for note in env.platform.probe_notes)
        return
    assert env.platform.numa.gpu_node == parse_numa_node(path.read_text())


def test_registered_host_copies_land_on_the_node_asked_for() -> None:
    env = capture_env(os.environ)
    node = env.platform.numa.gpu_node if env.platform.numa.gpu_node is not None else 0
    runtime = CudaRuntime(numa_node=node)
    weight = torch.randn(2048, 2048, device="cuda")
    host = runtime.host_copy(weight, pin=PinMethod.REGISTER)
    assert torch.equal(host, weight.cpu())
    placer = runtime.numa_placer
    assert placer is not None
    entry = parse_numa_maps(Path("/proc/self/numa_maps").read_text(), host.data_ptr())
    assert entry is not None
    if placer.fallback_reason is not None:
        assert entry.policy == "default"
        pytest.skip(f"mbind is unavailable here: {placer.fallback_reason}")
    assert entry.policy == f"prefer:{node}"
    assert entry.nodes == (node,), entry
    runtime.release_host(host)


def test_the_default_runtime_takes_the_plans_node() -> None:
    env = capture_env(os.environ)
    layers = [torch.nn.Linear(64, 64, device="cuda") for _ in range(2)]
    plan = make_plan(describe_layers(layers), OffloadConfig(group_size=2), env)
    runtime = default_runtime(plan)
    assert isinstance(runtime, CudaRuntime)
    placer = runtime.numa_placer
    assert (placer.node if placer is not None else None) == plan.host_numa.node
