"""NUMA placement of host copies: sysfs parsers, the decision, the plan
field, its rendering and its JSON (old documents without it still load)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from offload.errors import ConfigError, PlanError
from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    PinMethod,
    Platform,
    make_plan,
    render_plan,
)
from offload.pure.decide.numa import HostNuma, NumaReason, decide_numa
from offload.pure.env.numa import (
    NumaTopology,
    format_node_list,
    normalise_pci_bus_id,
    parse_node_list,
    parse_numa_maps,
    parse_numa_node,
    pci_bus_id,
)
from offload.pure.serialize import from_data, to_data
from tests.pure.strategies import model_specs, numa_topologies, offload_configs, platforms

# ============================================================================ parsers


@pytest.mark.parametrize(
    ("text", "nodes"),
    [("0", (0,)), ("0\n", (0,)), ("0-1", (0, 1)), ("0,2-3", (0, 2, 3)), ("0-1,1", (0, 1)),
     (" 4 \n", (4,)), ("", ()), ("\n", ()), ("1,0", (0, 1)), ("0-7", tuple(range(8)))],
)
def test_parse_node_list(text: str, nodes: tuple[int, ...]) -> None:
    assert parse_node_list(text) == nodes


@pytest.mark.parametrize("text", ["-1", "a", "0-", "3-1", "0,,1", "1.5", "²", "0-99999", "0 1"])
def test_parse_node_list_refuses_junk(text: str) -> None:
    with pytest.raises(ValueError, match="node"):
        parse_node_list(text)


@pytest.mark.parametrize(("text", "node"), [("0", 0), ("1\n", 1), ("-1", None), ("-1\n", None), (" 3 ", 3)])
def test_parse_numa_node(text: str, node: int | None) -> None:
    assert parse_numa_node(text) == node


@pytest.mark.parametrize("text", ["", "-2", "x", "1 2", "0x1"])
def test_parse_numa_node_refuses_junk(text: str) -> None:
    with pytest.raises(ValueError, match="numa_node"):
        parse_numa_node(text)


@pytest.mark.parametrize(("nodes", "text"), [((), ""), ((0,), "0"), ((0, 1), "0-1"), ((0, 2, 3), "0,2-3"),
                                             ((0, 2, 4, 5, 6), "0,2,4-6")])
def test_format_node_list_inverts_the_parser(nodes: tuple[int, ...], text: str) -> None:
    assert format_node_list(nodes) == text
    assert parse_node_list(text) == nodes


@pytest.mark.parametrize(
    ("text", "sysfs"),
    [("0000:17:00.0", "0000:17:00.0"), ("00000000:17:00.0", "0000:17:00.0"), ("0000:C1:00.0", "0000:c1:00.0"),
     ("17:00.0", "0000:17:00.0"), ("0001:00:1f.3", "0001:00:1f.3"), ("0000:65:00", "0000:65:00.0")],
)
def test_bus_ids_take_the_sysfs_spelling(text: str, sysfs: str) -> None:
    assert normalise_pci_bus_id(text) == sysfs


@pytest.mark.parametrize("text", ["", "17", "0000:zz:00.0", "a:b:c:d"])
def test_bad_bus_ids_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="PCI bus id"):
        normalise_pci_bus_id(text)


def test_pci_bus_id_from_torch_numbers() -> None:
    assert pci_bus_id(0, 0x17, 0) == "0000:17:00.0"
    assert pci_bus_id(1, 0xC1, 0x1F, 3) == "0001:c1:1f.3"


NUMA_MAPS = (
    "5608b42bc000 default file=/usr/bin/head mapped=2 N0=2 kernelpagesize_kB=4\n"
    "7f48ef967000 prefer:0 file=/dev/zero\\040(deleted) dirty=256 active=0 N0=256 kernelpagesize_kB=4\n"
    "7f48ef000000 bind:1 anon=10 dirty=10 N0=3 N1=7 kernelpagesize_kB=4\n"
    "7f48e0000000 interleave:0-1 anon=1\n"
    "garbage\n"
)


def test_parse_numa_maps() -> None:
    placed = parse_numa_maps(NUMA_MAPS, 0x7F48EF967000)
    assert placed is not None
    assert (placed.policy, placed.pages, placed.nodes) == ("prefer:0", ((0, 256),), (0,))
    split = parse_numa_maps(NUMA_MAPS, 0x7F48EF000000)
    assert split is not None and (split.policy, split.pages) == ("bind:1", ((0, 3), (1, 7)))
    untouched = parse_numa_maps(NUMA_MAPS, 0x7F48E0000000)
    assert untouched is not None and (untouched.policy, untouched.pages) == ("interleave:0-1", ())
    assert parse_numa_maps(NUMA_MAPS, 0x1000) is None
    assert parse_numa_maps("", 0x1000) is None


# ============================================================================ topology


def test_topology_defaults_mean_unknown() -> None:
    assert NumaTopology() == NumaTopology(nodes=(), gpu_node=None)
    assert str(NumaTopology()) == "nodes unknown, GPU's node unknown"
    assert str(NumaTopology(nodes=(0, 1), gpu_node=1)) == "nodes 0-1, GPU on node 1"


@pytest.mark.parametrize(
    "kwargs",
    [{"nodes": (1, 0)}, {"nodes": (0, 0)}, {"nodes": (-1,)}, {"nodes": [0]}, {"nodes": (True,)},
     {"gpu_node": -1}, {"gpu_node": True}, {"gpu_node": "1"}, {"nodes": (0, 1), "gpu_node": 2}],
)
def test_topology_is_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PlanError) as caught:
        NumaTopology(**kwargs)
    assert caught.value.name in kwargs


def test_gpu_node_may_be_known_when_the_nodes_are_not() -> None:
    assert NumaTopology(gpu_node=3).gpu_node == 3


def test_platform_validates_its_topology() -> None:
    with pytest.raises(PlanError, match="numa"):
        Platform(numa=(0, 1))  # type: ignore[arg-type]  # the mistake under test


# ============================================================================ decision

ONE = NumaTopology(nodes=(0,), gpu_node=0)
TWO_GPU_ON_1 = NumaTopology(nodes=(0, 1), gpu_node=1)
TWO_GPU_UNKNOWN = NumaTopology(nodes=(0, 1))
UNKNOWN = NumaTopology()
REG, ALLOC, NONE = PinMethod.REGISTER, PinMethod.ALLOC, PinMethod.NONE

DECISIONS: list[tuple[NumaTopology, Any, str, PinMethod, int | None, NumaReason]] = [
    (ONE, "auto", "cuda", REG, None, NumaReason.SINGLE_NODE),
    (TWO_GPU_ON_1, "auto", "cuda", REG, 1, NumaReason.GPU_NODE),
    (TWO_GPU_UNKNOWN, "auto", "cuda", REG, None, NumaReason.GPU_NODE_UNKNOWN),
    (UNKNOWN, "auto", "cuda", REG, None, NumaReason.GPU_NODE_UNKNOWN),
    (NumaTopology(gpu_node=2), "auto", "cuda", REG, 2, NumaReason.GPU_NODE),
    (TWO_GPU_ON_1, 0, "cuda", REG, 0, NumaReason.USER_CHOICE),
    (ONE, 0, "cuda", REG, 0, NumaReason.USER_CHOICE),
    (UNKNOWN, 5, "cuda", REG, 5, NumaReason.USER_CHOICE_UNCHECKED),
    (TWO_GPU_ON_1, None, "cuda", REG, None, NumaReason.TURNED_OFF),
    (TWO_GPU_ON_1, "auto", "cpu", NONE, None, NumaReason.CPU_ONLY),
    (TWO_GPU_ON_1, 1, "cpu", NONE, None, NumaReason.CPU_ONLY),
    (TWO_GPU_ON_1, "auto", "cuda", NONE, None, NumaReason.NOT_PINNED),
    (TWO_GPU_ON_1, "auto", "cuda", ALLOC, None, NumaReason.DRIVER_ALLOCATED),
]


@pytest.mark.parametrize(("topology", "requested", "device", "pin", "node", "reason"), DECISIONS)
def test_decide_numa(topology: NumaTopology, requested: Any, device: str, pin: PinMethod, node: int | None,
                     reason: NumaReason) -> None:
    decision = decide_numa(topology, requested, compute_device=device, pin=pin)
    assert (decision.node, decision.reason) == (node, reason)


@pytest.mark.parametrize(("topology", "requested"), [(TWO_GPU_ON_1, 2), (ONE, 1), (TWO_GPU_ON_1, 7)])
def test_a_node_the_host_lacks_is_refused_naming_it(topology: NumaTopology, requested: int) -> None:
    with pytest.raises(PlanError, match=f"numa_node={requested} is not one of") as caught:
        decide_numa(topology, requested, compute_device="cuda", pin=REG)
    assert (caught.value.name, caught.value.value) == ("numa_node", requested)
    with pytest.raises(PlanError, match=f"numa_node={requested}"):  # refused even where unused
        decide_numa(topology, requested, compute_device="cpu", pin=NONE)


@pytest.mark.parametrize("requested", [-1, True, "1", 1.0, "AUTO"])
def test_decide_numa_refuses_what_is_not_a_request(requested: Any) -> None:
    with pytest.raises(PlanError, match="numa_node"):
        decide_numa(TWO_GPU_ON_1, requested, compute_device="cuda", pin=REG)


@settings(max_examples=100)
@given(numa_topologies())
def test_auto_places_exactly_on_the_gpu_node_of_a_multi_node_host(topology: NumaTopology) -> None:
    decision = decide_numa(topology, "auto", compute_device="cuda", pin=REG)
    expected = topology.gpu_node if len(topology.nodes) != 1 else None
    assert decision.node == expected


@pytest.mark.parametrize(
    ("decision", "text"),
    [(HostNuma(reason=NumaReason.GPU_NODE, node=1), "NUMA node 1 (the GPU's node)"),
     (HostNuma(reason=NumaReason.SINGLE_NODE), "no NUMA placement (single node)"),
     (HostNuma(reason=NumaReason.USER_CHOICE, node=0), "NUMA node 0 (chosen by the user)"),
     (HostNuma(reason=NumaReason.CPU_ONLY), "no NUMA placement (CPU-only: host copies are torch allocations)"),
     (HostNuma(), "no NUMA placement (not recorded: the plan was made before NUMA placement existed)")],
)
def test_host_numa_text(decision: HostNuma, text: str) -> None:
    assert decision.text == text


@pytest.mark.parametrize("reason", list(NumaReason))
def test_every_reason_has_words(reason: NumaReason) -> None:
    node = 0 if reason in (NumaReason.GPU_NODE, NumaReason.USER_CHOICE, NumaReason.USER_CHOICE_UNCHECKED) else None
    assert HostNuma(reason=reason, node=node).explanation


@pytest.mark.parametrize(
    "kwargs",
    [{"reason": NumaReason.GPU_NODE}, {"reason": NumaReason.SINGLE_NODE, "node": 0},
     {"reason": NumaReason.GPU_NODE, "node": -1}, {"reason": NumaReason.GPU_NODE, "node": True}],
)
def test_host_numa_gives_a_node_exactly_when_placing(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PlanError, match="node"):
        HostNuma(**kwargs)


# ============================================================================ config


@pytest.mark.parametrize("value", ["auto", None, 0, 3])
def test_config_accepts_numa_requests(value: Any) -> None:
    assert OffloadConfig(numa_node=value).numa_node == value


@pytest.mark.parametrize("value", [-1, True, "1", 1.5, "none"])
def test_config_refuses_other_numa_values_naming_them(value: Any) -> None:
    with pytest.raises(ConfigError, match="numa_node") as caught:
        OffloadConfig(numa_node=value)
    assert (caught.value.name, caught.value.value) == ("numa_node", value)


def test_config_default_is_auto() -> None:
    assert OffloadConfig().numa_node == "auto"


# ============================================================================ plan

GPU_TWO_NODES = Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=1000, can_map_host_memory=True,
                         can_register_host_memory=True, host_pointer_for_registered_memory=True,
                         numa=TWO_GPU_ON_1)
SPEC = ModelSpec(layers=tuple(
    LayerSpec(index=i, name=f"layers.{i}",
              params=(ParamSpec(name="w", shape=(64,), stride=(1,), dtype="float16", itemsize=2, device="compute"),))
    for i in range(4)
))
PREFETCH = OffloadConfig(group_size=2, num_in_group=1)


def test_plan_places_host_copies_on_the_gpu_node_and_says_so() -> None:
    plan = make_plan(SPEC, PREFETCH, EnvSnapshot(platform=GPU_TWO_NODES))
    assert plan.host_numa == HostNuma(reason=NumaReason.GPU_NODE, node=1)
    assert "host copies: NUMA node 1 (the GPU's node)" in render_plan(plan).splitlines()


def test_plan_on_a_single_node_host() -> None:
    platform = attrs.evolve(GPU_TWO_NODES, numa=ONE)
    plan = make_plan(SPEC, PREFETCH, EnvSnapshot(platform=platform))
    assert plan.host_numa.node is None
    assert "host copies: no NUMA placement (single node)" in render_plan(plan).splitlines()


def test_plan_on_the_cpu_says_cpu_only() -> None:
    plan = make_plan(SPEC, PREFETCH, EnvSnapshot(platform=Platform(numa=TWO_GPU_UNKNOWN)))
    assert plan.host_numa.reason is NumaReason.CPU_ONLY
    assert "host copies: no NUMA placement (CPU-only: host copies are torch allocations)" in render_plan(plan)


def test_plan_with_pinning_off_places_nothing() -> None:
    env = EnvSnapshot(flags=EnvFlags(disable_pin_memory=True), platform=GPU_TWO_NODES)
    assert make_plan(SPEC, PREFETCH, env).host_numa.reason is NumaReason.NOT_PINNED


def test_plan_takes_the_users_node_and_refuses_one_the_host_lacks() -> None:
    env = EnvSnapshot(platform=GPU_TWO_NODES)
    assert make_plan(SPEC, attrs.evolve(PREFETCH, numa_node=0), env).host_numa.node == 0
    assert make_plan(SPEC, attrs.evolve(PREFETCH, numa_node=None), env).host_numa.node is None
    with pytest.raises(PlanError, match="numa_node=3 is not one of this host's NUMA nodes \\(0-1\\)"):
        make_plan(SPEC, attrs.evolve(PREFETCH, numa_node=3), env)


def test_the_topology_is_in_the_fingerprint() -> None:
    env = EnvSnapshot(platform=GPU_TWO_NODES)
    moved = EnvSnapshot(platform=attrs.evolve(GPU_TWO_NODES, numa=NumaTopology(nodes=(0, 1), gpu_node=0)))
    assert env.fingerprint() != moved.fingerprint()


@settings(max_examples=40, deadline=None)
@given(model_specs(max_layers=5), offload_configs(), platforms())
def test_plans_round_trip_through_json_with_the_numa_field(spec: ModelSpec, config: OffloadConfig,
                                                           platform: Platform) -> None:
    plan = make_plan(spec, config, EnvSnapshot(platform=platform))
    assert OffloadPlan.from_json(plan.to_json()) == plan


def test_plan_json_holds_the_numa_field() -> None:
    plan = make_plan(SPEC, attrs.evolve(PREFETCH, numa_node=0), EnvSnapshot(platform=GPU_TWO_NODES))
    document = json.loads(plan.to_json())
    assert document["plan"]["host_numa"] == {"reason": "user_choice", "node": 0}
    assert document["plan"]["config"]["numa_node"] == 0
    assert OffloadPlan.from_json(plan.to_json()) == plan


def test_old_plan_json_without_the_numa_fields_still_loads() -> None:
    plan = make_plan(SPEC, PREFETCH, EnvSnapshot(platform=GPU_TWO_NODES))
    document = json.loads(plan.to_json())
    del document["plan"]["host_numa"]
    del document["plan"]["config"]["numa_node"]
    old = OffloadPlan.from_json(json.dumps(document))
    assert old.host_numa == HostNuma()  # not recorded: nothing is placed
    assert old.host_numa.node is None
    assert old.config.numa_node == "auto"
    assert attrs.evolve(old, host_numa=plan.host_numa) == plan
    assert "host copies: no NUMA placement (not recorded" in render_plan(old)


def test_tampered_numa_field_is_refused() -> None:
    plan = make_plan(SPEC, PREFETCH, EnvSnapshot(platform=GPU_TWO_NODES))
    document = json.loads(plan.to_json())
    document["plan"]["host_numa"] = {"reason": "single_node", "node": 1}
    with pytest.raises(PlanError, match="node"):
        OffloadPlan.from_json(json.dumps(document))
    document["plan"]["host_numa"] = {"reason": "somewhere", "node": None}
    with pytest.raises(PlanError, match="host_numa.reason"):
        OffloadPlan.from_json(json.dumps(document))


def test_old_snapshot_data_without_the_topology_still_loads() -> None:
    env = EnvSnapshot(platform=GPU_TWO_NODES)
    data = to_data(env)
    assert data["platform"]["numa"] == {"nodes": [0, 1], "gpu_node": 1}
    assert from_data(EnvSnapshot, data) == env
    del data["platform"]["numa"]
    assert from_data(EnvSnapshot, data).platform.numa == NumaTopology()
