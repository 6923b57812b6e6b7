"""The host's NUMA nodes and the GPU's among them, as a value; and the user's request.

Kept apart from `offload.pure.numa` (the parsers and the placement decision) because
`Platform` holds a `NumaTopology`, and the decision reads the pin decision, which reads
`Platform`: this module depends on nothing but the error tree and the shared validators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from offload.errors import OffloadError, PlanError
from offload.pure._checks import is_int

__all__ = ["NumaRequest", "NumaTopology", "check_numa_request", "format_node_list", "numa_request", "numa_topology"]

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
