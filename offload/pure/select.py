"""Which parameters leave the compute device: the selection rules of each backend.

Selection works on *storage groups*: a tied parameter (several names, one storage) is
offloaded as a whole or not at all, so that it is stored once and counted once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from offload.pure.config import OffloadConfig, segment_matches
from offload.pure.env import Platform
from offload.pure.spec import COMPUTE_DEVICE, ModelSpec, ParamSpec

__all__ = [
    "Selection",
    "StorageGroup",
    "filter_misses",
    "group_storages",
    "is_on_compute_device",
    "prefetch_layers",
    "select_prefetch",
    "select_uva",
]

#: Where a parameter is, as (layer index, name).
Ref = tuple[int, str]


def is_on_compute_device(device: str, platform: Platform) -> bool:
    """True when a parameter on `device` is on the platform's compute device.

    Not-yet-loaded weights (`COMPUTE_DEVICE`, and ``meta`` placeholders that will be
    materialised there) count as on it. On a CUDA platform the compute device is CUDA and
    parameters already on the host are left alone; without an accelerator it is the CPU.
    """
    if device in (COMPUTE_DEVICE, "meta"):
        return True
    if platform.has_cuda:
        return device == "cuda" or device.startswith("cuda:")
    return device == "cpu"


@attrs.frozen(kw_only=True)
class StorageGroup:
    """Parameters that share one storage (a single parameter when untied).

    Attributes:
        members: (layer, param) in model order; the first holds the one host copy.
    """

    members: tuple[tuple[int, ParamSpec], ...]

    @property
    def primary(self) -> Ref:
        """(layer, name) of the first member."""
        layer, param = self.members[0]
        return (layer, param.name)

    @property
    def nbytes(self) -> int:
        """Bytes of the shared storage, counted once."""
        return self.members[0][1].nbytes


def group_storages(spec: ModelSpec) -> tuple[StorageGroup, ...]:
    """Group parameters by storage key, in order of each group's first member."""
    order: list[list[tuple[int, ParamSpec]]] = []
    by_key: dict[str, list[tuple[int, ParamSpec]]] = {}
    for layer in spec.layers:
        for param in layer.params:
            if param.storage_key is None:
                order.append([(layer.index, param)])
                continue
            members = by_key.get(param.storage_key)
            if members is None:
                members = by_key[param.storage_key] = []
                order.append(members)
            members.append((layer.index, param))
    return tuple(StorageGroup(members=tuple(m)) for m in order)


def _eligible(layer_and_param: tuple[int, ParamSpec], config: OffloadConfig, platform: Platform) -> bool:
    _, param = layer_and_param
    if not is_on_compute_device(param.device, platform):
        return False
    return not config.param_filter or any(segment_matches(s, param.name) for s in config.param_filter)


def filter_misses(spec: ModelSpec, param_filter: Sequence[str]) -> tuple[str, ...]:
    """The filter segments that match no parameter name of the model."""
    names = {p.name for layer in spec.layers for p in layer.params}
    return tuple(s for s in param_filter if not any(segment_matches(s, n) for n in names))


@attrs.frozen(kw_only=True)
class Selection:
    """The outcome of selection.

    Attributes:
        offloaded: the groups that leave the compute device, in model order.
        split_ties: groups left resident because only some of their members could go.
    """

    offloaded: tuple[StorageGroup, ...]
    split_ties: tuple[StorageGroup, ...]


def prefetch_layers(num_layers: int, group_size: int, num_in_group: int) -> tuple[int, ...]:
    """The last `num_in_group` layers of every `group_size` (8 and 2: 6, 7, 14, 15, ...)."""
    return tuple(i for i in range(num_layers) if i % group_size >= group_size - num_in_group)


def _select(
    groups: Iterable[StorageGroup], wanted: frozenset[int] | None, config: OffloadConfig, platform: Platform
) -> tuple[list[StorageGroup], list[StorageGroup]]:
    """Split groups into those whose every member can go, and ties only partly eligible."""
    whole: list[StorageGroup] = []
    split: list[StorageGroup] = []
    for group in groups:
        ok = [(wanted is None or lp[0] in wanted) and _eligible(lp, config, platform) for lp in group.members]
        if all(ok):
            whole.append(group)
        elif any(ok):
            split.append(group)
    return whole, split


def select_prefetch(spec: ModelSpec, config: OffloadConfig, platform: Platform) -> Selection:
    """Prefetch: eligible parameters of the layers `prefetch_layers` names."""
    wanted = frozenset(prefetch_layers(len(spec.layers), config.group_size, config.num_in_group))
    whole, split = _select(group_storages(spec), wanted, config, platform)
    return Selection(offloaded=tuple(whole), split_ties=tuple(split))


def select_uva(spec: ModelSpec, config: OffloadConfig, platform: Platform) -> Selection:
    """UVA: eligible parameters in layer order until `uva_max_bytes` is reached.

    The parameter that reaches the budget is taken whole, so the total may cross it.
    """
    whole, split = _select(group_storages(spec), None, config, platform)
    taken: list[StorageGroup] = []
    total = 0
    for group in whole:
        if total >= config.uva_max_bytes:
            break
        taken.append(group)
        total += group.nbytes
    return Selection(offloaded=tuple(taken), split_ties=tuple(split))
