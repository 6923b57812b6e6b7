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
    "group_nbytes",
    "group_primary",
    "group_storages",
    "is_on_compute_device",
    "prefetch_layers",
    "select_prefetch",
    "select_uva",
]

#: Where a parameter is, as (layer index, name).
Ref = tuple[int, str]


def is_on_compute_device(device: str, platform: Platform, *, keep_host: bool = False) -> bool:
    """True when a parameter on `device` is eligible for the platform's compute device:
    offloaded from it, or counted as resident on it.

    Weights go to the compute device from wherever they are: already on it, not yet
    loaded (`COMPUTE_DEVICE`, ``meta``), or in host memory (a model loaded on the host and
    planned for a GPU). Only with `keep_host` (``OffloadConfig.keep_host_params``) are
    parameters in host memory on a CUDA platform left alone. Another device (a second
    GPU) is never eligible.
    """
    if device in (COMPUTE_DEVICE, "meta"):
        return True
    if device == "cpu":
        return not (keep_host and platform.has_cuda)
    if platform.has_cuda:
        return device == "cuda" or device.startswith("cuda:")
    return False


#: Parameters that share one storage, as (layer, param) in model order; a single
#: parameter when untied. The first member holds the one host copy. (A plain tuple: a
#: large model has tens of thousands of these and make_plan has a time budget.)
StorageGroup = tuple[tuple[int, ParamSpec], ...]


def group_primary(group: StorageGroup) -> Ref:
    """(layer, name) of the group's first member."""
    layer, param = group[0]
    return (layer, param.name)


def group_nbytes(group: StorageGroup) -> int:
    """Bytes of the group's storage, counted once."""
    return group[0][1].nbytes


def group_storages(spec: ModelSpec) -> tuple[StorageGroup, ...]:
    """Group parameters by storage key, in order of each group's first member."""
    order: list[StorageGroup | list[tuple[int, ParamSpec]]] = []
    by_key: dict[str, list[tuple[int, ParamSpec]]] = {}
    for layer in spec.layers:
        index = layer.index
        for param in layer.params:
            key = param.storage_key
            if key is None:
                order.append(((index, param),))
                continue
            members = by_key.get(key)
            if members is None:
                members = by_key[key] = []
                order.append(members)
            members.append((index, param))
    return tuple(m if isinstance(m, tuple) else tuple(m) for m in order)


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
        cross_layer_ties: prefetch only: groups left resident because they span layers,
            and one parameter object cannot point at two layers' buffers.
    """

    offloaded: tuple[StorageGroup, ...]
    split_ties: tuple[StorageGroup, ...]
    cross_layer_ties: tuple[StorageGroup, ...] = ()


def prefetch_layers(num_layers: int, group_size: int, num_in_group: int) -> tuple[int, ...]:
    """The last `num_in_group` layers of every `group_size` (8 and 2: 6, 7, 14, 15, ...)."""
    return tuple(i for i in range(num_layers) if i % group_size >= group_size - num_in_group)


def _select(
    groups: Iterable[StorageGroup], wanted: frozenset[int] | None, config: OffloadConfig, platform: Platform
) -> tuple[list[StorageGroup], list[StorageGroup]]:
    """Split groups into those whose every member can go, and ties only partly eligible."""
    # Device names and parameter names repeat across layers: decide each once.
    device_ok: dict[str, bool] = {}
    name_ok: dict[str, bool] = {}
    segments = config.param_filter

    def eligible(layer: int, param: ParamSpec) -> bool:
        if wanted is not None and layer not in wanted:
            return False
        on_device = device_ok.get(param.device)
        if on_device is None:
            on_device = device_ok[param.device] = is_on_compute_device(param.device, platform,
                                                                      keep_host=config.keep_host_params)
        if not on_device:
            return False
        if not segments:
            return True
        match = name_ok.get(param.name)
        if match is None:
            match = name_ok[param.name] = any(segment_matches(s, param.name) for s in segments)
        return match

    whole: list[StorageGroup] = []
    split: list[StorageGroup] = []
    for group in groups:
        if len(group) == 1:
            if eligible(*group[0]):
                whole.append(group)
            continue
        ok = [eligible(layer, param) for layer, param in group]
        if all(ok):
            whole.append(group)
        elif any(ok):
            split.append(group)
    return whole, split


def select_prefetch(
    groups: Sequence[StorageGroup], num_layers: int, config: OffloadConfig, platform: Platform
) -> Selection:
    """Prefetch: eligible parameters of the layers `prefetch_layers` names.

    Args:
        groups: `group_storages` of the model.
        num_layers: how many layers the model has.
        config: the request (group size, number in group, filter).
        platform: decides which parameters are on the compute device.
    """
    wanted = frozenset(prefetch_layers(num_layers, config.group_size, config.num_in_group))
    whole, split = _select(groups, wanted, config, platform)
    # A storage tied across layers would need one buffer per layer, but its parameters
    # (often one Parameter object) can only point at one: keep such ties resident.
    same_layer = [g for g in whole if len(g) == 1 or all(layer == g[0][0] for layer, _ in g)]
    across = [g for g in whole if not (len(g) == 1 or all(layer == g[0][0] for layer, _ in g))]
    return Selection(offloaded=tuple(same_layer), split_ties=tuple(split), cross_layer_ties=tuple(across))


def select_uva(groups: Sequence[StorageGroup], config: OffloadConfig, platform: Platform) -> Selection:
    """UVA: eligible parameters in layer order until `uva_max_bytes` is reached.

    The parameter that reaches the budget is taken whole, so the total may cross it.

    Args:
        groups: `group_storages` of the model.
        config: the request (byte budget, filter).
        platform: decides which parameters are on the compute device.
    """
    whole, split = _select(groups, None, config, platform)
    taken: list[StorageGroup] = []
    total = 0
    for group in whole:
        if total >= config.uva_max_bytes:
            break
        taken.append(group)
        total += group_nbytes(group)
    return Selection(offloaded=tuple(taken), split_ties=tuple(split))
