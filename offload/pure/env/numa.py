"""The host's NUMA nodes and the GPU's among them, as a value; the user's request; and the
parsers of the sysfs and ``numa_maps`` texts the shell reads (`offload.capture.numa`).

Kept apart from `offload.pure.decide.numa` (the placement decision) because `Platform`
holds a `NumaTopology`, and the decision reads the pin decision, which reads `Platform`:
this module depends on nothing but the error tree and the shared validators. The
``numa_maps`` parser reads the kernel's account of where a mapping's pages are, for tests
and benchmarks that check the placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from offload.errors import OffloadError, PlanError
from offload.pure._checks import is_int

__all__ = [
    "MAX_NODE",
    "NumaMapsEntry",
    "NumaRequest",
    "NumaTopology",
    "check_numa_request",
    "format_node_list",
    "normalise_pci_bus_id",
    "numa_request",
    "numa_topology",
    "parse_node_list",
    "parse_numa_maps",
    "parse_numa_node",
    "pci_bus_id",
]

#: Where the user wants host copies: a NUMA node number, "auto" (the GPU's node where
#: that helps), or None (no placement).
NumaRequest = int | Literal["auto"] | None


def format_node_list(nodes: tuple[int, ...]) -> str:
    """Nodes in the kernel's list syntax: ``(0, 2, 3)`` -> ``"0,2-3"``; ``""`` for none."""
    parts: list[str] = []
    start = prev = None
    for node in nodes:
        if prev is not None and node == prev + 1:
            prev = node
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = node
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _nodes(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        not isinstance(value, tuple)
        or not all(is_int(v) and v >= 0 for v in value)
        or list(value) != sorted(set(value))
    ):
        raise PlanError(
            f"{attribute.name} must be a sorted tuple of distinct NUMA node numbers >= 0, got {value!r}",
            name=attribute.name,
            value=value,
        )


def _gpu_node(instance: NumaTopology, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not is_int(value) or value < 0:
        raise PlanError(f"{attribute.name} must be None or a NUMA node number >= 0, got {value!r}",
                        name=attribute.name, value=value)
    if instance.nodes and value not in instance.nodes:
        raise PlanError(
            f"{attribute.name} {value} is not one of the host's nodes ({format_node_list(instance.nodes)})",
            name=attribute.name,
            value=value,
        )


@attrs.frozen(kw_only=True)
class NumaTopology:
    """The host's NUMA nodes and the one the GPU is attached to. The defaults mean unknown.

    Attributes:
        nodes: the online NUMA node numbers (``/sys/devices/system/node/online``), sorted;
            empty when unknown.
        gpu_node: the node of the compute GPU's PCI device (its sysfs ``numa_node``); None
            without CUDA, when unknown, or when the device reports no affinity (-1). When
            `nodes` is known it is one of them.
    """

    nodes: tuple[int, ...] = attrs.field(default=(), validator=_nodes)
    gpu_node: int | None = attrs.field(default=None, validator=_gpu_node)

    def __str__(self) -> str:
        nodes = f"nodes {format_node_list(self.nodes)}" if self.nodes else "nodes unknown"
        gpu = "GPU's node unknown" if self.gpu_node is None else f"GPU on node {self.gpu_node}"
        return f"{nodes}, {gpu}"


def check_numa_request(name: str, value: object, error: type[OffloadError]) -> None:
    """Raise `error` naming `name` unless `value` is a `NumaRequest`: an int >= 0 (not a
    bool), ``"auto"`` or None."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return
    if not is_int(value) or value < 0:
        raise error(
            f"{name} must be a NUMA node number >= 0, 'auto' or None, got {value!r}",
            name=name,
            value=value,
        )


def numa_request(error: type[OffloadError]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator for a `NumaRequest` field, raising `error`."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_numa_request(attribute.name, value, error)

    return check


def numa_topology(error: type[OffloadError]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator accepting a `NumaTopology`, raising `error` otherwise."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, NumaTopology):
            raise error(f"{attribute.name} must be a NumaTopology, got {value!r}",
                        name=attribute.name, value=value)

    return check


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
