"""NUMA placement of host copies: the sysfs texts the probe reads, and the decision.

Page-locked host memory lands on whichever NUMA node first touches it; host-to-device
copies (and zero-copy reads) are fastest from the node the GPU's PCI device hangs off.
`decide_numa` picks the node once, for the plan (`OffloadPlan.host_numa`); the CUDA
runtime binds each host mapping to it before the first touch (`offload.runtime.numa`).

The parsers take texts the shell has read (`offload.capture.numa`) and return values; the
``numa_maps`` parser reads the kernel's account of where a mapping's pages are, for
tests and benchmarks that check the placement.
"""

from __future__ import annotations

import enum

import attrs

from offload.errors import PlanError
from offload.pure.decisions import PinMethod
from offload.pure.numa_topology import NumaRequest, NumaTopology, check_numa_request, format_node_list

__all__ = [
    "HostNuma",
    "NumaMapsEntry",
    "NumaReason",
    "NumaRequest",
    "NumaTopology",
    "decide_numa",
    "format_node_list",
    "normalise_pci_bus_id",
    "parse_node_list",
    "parse_numa_maps",
    "parse_numa_node",
    "pci_bus_id",
]

#: Nodes beyond this are refused by the parsers: the kernel's limit (CONFIG_NODES_SHIFT
#: at most 10) is 1024, and a larger number in a list is damage, not a machine.
MAX_NODE = 1023


def _number(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{what} {text!r} is not a node number")
    value = int(text)
    if value > MAX_NODE:
        raise ValueError(f"{what} {value} is beyond the kernel's largest node number ({MAX_NODE})")
    return value


def parse_node_list(text: str) -> tuple[int, ...]:
    """Read a kernel node list (``/sys/devices/system/node/online``).

    Args:
        text: e.g. ``"0\\n"``, ``"0-1"``, ``"0,2-3"``; an empty text is no nodes.

    Returns:
        The nodes, sorted, each once.

    Raises:
        ValueError: a part is not ``N`` or ``N-M`` with N <= M <= `MAX_NODE`.
    """
    nodes: set[int] = set()
    body = text.strip()
    if not body:
        return ()
    for part in body.split(","):
        first, dash, last = part.strip().partition("-")
        low = _number(first, "node")
        high = _number(last, "node") if dash else low
        if high < low:
            raise ValueError(f"node range {part.strip()!r} runs backwards")
        nodes.update(range(low, high + 1))
    return tuple(sorted(nodes))


def parse_numa_node(text: str) -> int | None:
    """Read a PCI device's ``numa_node`` file.

    Args:
        text: e.g. ``"1\\n"``; ``"-1"`` means the device has no NUMA affinity.

    Returns:
        The node, or None for -1.

    Raises:
        ValueError: the text is neither -1 nor a node number.
    """
    body = text.strip()
    if body == "-1":
        return None
    return _number(body, "numa_node")


def pci_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs name of a PCI device: ``domain:bus:device.function`` in lower-case hex
    (``0000:17:00.0``), as under /sys/bus/pci/devices."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def normalise_pci_bus_id(text: str) -> str:
    """A bus id as CUDA or nvidia-smi print it (``00000000:17:00.0``, upper-case) in the
    sysfs spelling (``0000:17:00.0``).

    Raises:
        ValueError: `text` is not ``[domain:]bus:device.function`` in hex.
    """
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        raise ValueError(f"PCI bus id {text!r} is not domain:bus:device.function")
    device, dot, function = parts[2].partition(".")
    try:
        numbers = [int(p, 16) for p in (parts[0], parts[1], device, function if dot else "0")]
    except ValueError:
        raise ValueError(f"PCI bus id {text!r} is not hexadecimal") from None
    return pci_bus_id(*numbers)


@attrs.frozen(kw_only=True)
class NumaMapsEntry:
    """One mapping's line of ``/proc/<pid>/numa_maps``.

    Attributes:
        address: the mapping's start address.
        policy: its memory policy as the kernel prints it (``default``, ``bind:0``,
            ``prefer:1``, ``interleave:0-1``).
        pages: (node, pages on it) for each node holding some of its pages, by node.
    """

    address: int
    policy: str
    pages: tuple[tuple[int, int], ...]

    @property
    def nodes(self) -> tuple[int, ...]:
        """The nodes holding its pages."""
        return tuple(node for node, _ in self.pages)


def parse_numa_maps(text: str, address: int) -> NumaMapsEntry | None:
    """The line of a ``numa_maps`` text for the mapping starting at `address`.

    Args:
        text: the whole file; each line is ``<hex start> <policy> key=value ...``, with
            ``N<node>=<pages>`` for each node holding pages.
        address: the mapping's first byte.

    Returns:
        The entry, or None when no mapping starts there.
    """
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        try:
            start = int(fields[0], 16)
        except ValueError:
            continue
        if start != address:
            continue
        pages: list[tuple[int, int]] = []
        for field in fields[2:]:
            key, eq, value = field.partition("=")
            if eq and key[:1] == "N" and key[1:].isdigit() and value.isdigit():
                pages.append((int(key[1:]), int(value)))
        return NumaMapsEntry(address=start, policy=fields[1], pages=tuple(sorted(pages)))
    return None


class NumaReason(enum.Enum):
    """Why host copies are, or are not, placed on a NUMA node."""

    GPU_NODE = "gpu_node"
    USER_CHOICE = "user_choice"
    USER_CHOICE_UNCHECKED = "user_choice_unchecked"
    SINGLE_NODE = "single_node"
    GPU_NODE_UNKNOWN = "gpu_node_unknown"
    TURNED_OFF = "turned_off"
    CPU_ONLY = "cpu_only"
    NOT_PINNED = "not_pinned"
    DRIVER_ALLOCATED = "driver_allocated"
    NOT_RECORDED = "not_recorded"


_PLACED = frozenset({NumaReason.GPU_NODE, NumaReason.USER_CHOICE, NumaReason.USER_CHOICE_UNCHECKED})

_NUMA_TEXT = {
    NumaReason.GPU_NODE: "the GPU's node",
    NumaReason.USER_CHOICE: "chosen by the user",
    NumaReason.USER_CHOICE_UNCHECKED: "chosen by the user; the host's nodes are unknown, so it was not checked",
    NumaReason.SINGLE_NODE: "single node",
    NumaReason.GPU_NODE_UNKNOWN: "the GPU's NUMA node is unknown",
    NumaReason.TURNED_OFF: "turned off by the user (numa_node=None)",
    NumaReason.CPU_ONLY: "CPU-only: host copies are torch allocations",
    NumaReason.NOT_PINNED: "host copies are not pinned: pageable torch allocations",
    NumaReason.DRIVER_ALLOCATED: "host copies are cudaHostAlloc allocations, which the driver places",
    NumaReason.NOT_RECORDED: "not recorded: the plan was made before NUMA placement existed",
}


def _node_matches_reason(instance: HostNuma, attribute: attrs.Attribute[int | None], node: int | None) -> None:
    placed = instance.reason in _PLACED
    if node is not None and (type(node) is not int or node < 0):
        raise PlanError(f"{attribute.name} must be None or a NUMA node number >= 0, got {node!r}",
                        name=attribute.name, value=node)
    if (node is not None) != placed:
        raise PlanError(
            f"host_numa: a node is given exactly when host copies are placed; got node {node!r} "
            f"with reason {instance.reason.value}",
            name=attribute.name,
            value=node,
        )


@attrs.frozen(kw_only=True)
class HostNuma:
    """The NUMA node the host copies of offloaded weights are placed on, and why.

    Attributes:
        reason: why (first: the node's validator reads it).
        node: the node, bound before the memory is first touched (preferred, so a full
            node spills to others instead of failing); None for no placement. Given
            exactly for `NumaReason.GPU_NODE` and the user-choice reasons.
    """

    reason: NumaReason = attrs.field(default=NumaReason.NOT_RECORDED,
                                     validator=attrs.validators.instance_of(NumaReason))
    node: int | None = attrs.field(default=None, validator=_node_matches_reason)

    @property
    def explanation(self) -> str:
        """Why, in a few words."""
        return _NUMA_TEXT[self.reason]

    @property
    def text(self) -> str:
        """One phrase for people: ``NUMA node 1 (the GPU's node)``, ``no NUMA placement
        (single node)``."""
        if self.node is None:
            return f"no NUMA placement ({self.explanation})"
        return f"NUMA node {self.node} ({self.explanation})"


def decide_numa(
    topology: NumaTopology, requested: NumaRequest, *, compute_device: str, pin: PinMethod
) -> HostNuma:
    """Decide, once, which NUMA node host copies are placed on.

    A node the user names must be one of the host's nodes (when those are known) even
    where it cannot be used. Then only memory this library maps and registers itself can
    be placed: none on the CPU compute device (host copies are torch allocations), none
    unpinned (pageable torch allocations), none from cudaHostAlloc (the driver allocates
    and touches it). Then the user's choice (a node, or None for none); then "auto": no
    placement on a single-node host or when the GPU's node is unknown, else the GPU's
    node.

    Args:
        topology: the host's nodes and the GPU's (`Platform.numa`).
        requested: `OffloadConfig.numa_node`.
        compute_device: the plan's compute device, ``"cuda"`` or ``"cpu"``.
        pin: the plan's pin method.

    Returns:
        The node and the reason.

    Raises:
        PlanError: `requested` is not a `NumaRequest`, or names a node the host does not
            have; the error names the value.
    """
    check_numa_request("numa_node", requested, PlanError)
    if isinstance(requested, int) and topology.nodes and requested not in topology.nodes:
        raise PlanError(
            f"numa_node={requested} is not one of this host's NUMA nodes "
            f"({format_node_list(topology.nodes)}); use one of them, 'auto' or None",
            name="numa_node",
            value=requested,
        )
    if compute_device != "cuda":
        return HostNuma(reason=NumaReason.CPU_ONLY)
    if pin is PinMethod.NONE:
        return HostNuma(reason=NumaReason.NOT_PINNED)
    if pin is PinMethod.ALLOC:
        return HostNuma(reason=NumaReason.DRIVER_ALLOCATED)
    if requested is None:
        return HostNuma(reason=NumaReason.TURNED_OFF)
    if isinstance(requested, int):
        reason = NumaReason.USER_CHOICE if topology.nodes else NumaReason.USER_CHOICE_UNCHECKED
        return HostNuma(reason=reason, node=requested)
    if len(topology.nodes) == 1:
        return HostNuma(reason=NumaReason.SINGLE_NODE)
    if topology.gpu_node is None:
        return HostNuma(reason=NumaReason.GPU_NODE_UNKNOWN)
    return HostNuma(reason=NumaReason.GPU_NODE, node=topology.gpu_node)
