"""NUMA placement of host copies: the decision (the sysfs parsers are `offload.pure.env.numa`).

Page-locked host memory lands on whichever NUMA node first touches it; host-to-device
copies (and zero-copy reads) are fastest from the node the GPU's PCI device hangs off.
`decide_numa` picks the node once, for the plan (`OffloadPlan.host_numa`); the CUDA
runtime binds each host mapping to it before the first touch (`offload.runtime.numa`).

"""

from __future__ import annotations

import enum

import attrs

from offload.errors import PlanError
from offload.pure.decide.pinning import PinMethod
from offload.pure.env.numa import NumaRequest, NumaTopology, check_numa_request, format_node_list

__all__ = ["HostNuma", "NumaReason", "decide_numa"]

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
