"""Which parameters leave the compute device: the selection rules of each backend.

Selection works on *storage groups*: a tied parameter (several names, one storage) is
offloaded as a whole or not at all, so that it is stored once and counted once. Untied
parameters are groups of one; a large model has tens of thousands and `make_plan` has a
time budget, so they are chosen a layer at a time, and only the tied ones are grouped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate, chain
from operator import attrgetter
from types import MappingProxyType

import attrs

from offload.pure.config import OffloadConfig, segment_matches
from offload.pure.env.snapshot import Platform
from offload.pure.spec.values import COMPUTE_DEVICE, ModelSpec, ParamSpec

__all__ = [
    "Eligible",
    "LayerChoice",
    "NOTHING_SELECTED",
    "Selection",
    "StorageGroup",
    "devices_on_compute",
    "eligibility",
    "filter_misses",
    "group_nbytes",
    "group_primary",
    "is_on_compute_device",
    "prefetch_layers",
    "select_prefetch",
    "select_uva",
    "tied_storages",
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


#: Parameters that share one storage, as (layer, param) in model order. The first member
#: holds the one host copy. (A plain tuple, not a class: cheap to build in bulk.)
StorageGroup = tuple[tuple[int, ParamSpec], ...]

#: The parameters of one layer that are offloaded: None for all of them, else their names.
LayerChoice = frozenset[str] | None

_PARAMS = attrgetter("params")
_STORAGE_KEY = attrgetter("storage_key")
_DEVICE = attrgetter("device")
_NBYTES = attrgetter("nbytes")


def group_primary(group: StorageGroup) -> Ref:
    """(layer, name) of the group's first member."""
    layer, param = group[0]
    return (layer, param.name)


def group_nbytes(group: StorageGroup) -> int:
    """Bytes of the group's storage, counted once."""
    return group[0][1].nbytes


def tied_storages(spec: ModelSpec) -> tuple[StorageGroup, ...]:
    """The storage groups of more than one parameter (ties), in order of first member."""
    keys = list(map(_STORAGE_KEY, chain.from_iterable(map(_PARAMS, spec.layers))))
    distinct = set(keys)
    distinct.discard(None)
    if len(distinct) == len(keys) - keys.count(None):
        return ()  # every key once: nothing is tied (the common case, found in C)
    seen: set[str] = set()
    tied: set[str] = set()
    for key in keys:
        if key is not None:
            if key in seen:
                tied.add(key)
            seen.add(key)
    groups: dict[str, list[tuple[int, ParamSpec]]] = {}
    for layer in spec.layers:
        for param in layer.params:
            if param.storage_key in tied:
                groups.setdefault(param.storage_key, []).append((layer.index, param))
    return tuple(tuple(members) for members in groups.values())


def filter_misses(spec: ModelSpec, param_filter: Sequence[str]) -> tuple[str, ...]:
    """The filter segments that match no parameter name of the model."""
    if not param_filter:
        return ()
    names = {p.name for layer in spec.layers for p in layer.params}
    return tuple(s for s in param_filter if not any(segment_matches(s, n) for n in names))


def devices_on_compute(spec: ModelSpec, config: OffloadConfig, platform: Platform) -> dict[str, bool]:
    """`is_on_compute_device` of every device the parameters of `spec` are on (a few
    names, however many parameters), with ``config.keep_host_params``."""
    devices = set(map(_DEVICE, chain.from_iterable(map(_PARAMS, spec.layers))))
    return {d: is_on_compute_device(d, platform, keep_host=config.keep_host_params) for d in sorted(devices)}


#: Whether one parameter, wherever its layer, may leave the compute device.
Eligible = Callable[[ParamSpec], bool]


def eligibility(on_device: Mapping[str, bool], config: OffloadConfig) -> tuple[Eligible, bool]:
    """Which parameters may leave the compute device, by device and `param_filter`.

    Args:
        on_device: `devices_on_compute` of the model.
        config: the request (its filter).

    Returns:
        The test for one parameter of the model, and True when it passes every one (no
        filter, and every device is the compute device's): then whole layers can be
        taken without asking it per parameter.
    """
    segments = config.param_filter
    name_ok: dict[str, bool] = {}  # parameter names repeat across layers: match each once

    def eligible(param: ParamSpec) -> bool:
        if not on_device[param.device]:
            return False
        if not segments:
            return True
        match = name_ok.get(param.name)
        if match is None:
            match = name_ok[param.name] = any(segment_matches(s, param.name) for s in segments)
        return match

    return eligible, not segments and all(on_device.values())


@attrs.frozen(kw_only=True, eq=False)
class Selection:
    """The outcome of selection.

    Attributes:
        offloaded: for each layer with a parameter that leaves the compute device (and
            only those), which of its parameters do (`LayerChoice`). A tied storage is
            in it whole or not at all.
        offloaded_bytes: bytes of the storages that leave, each counted once.
        split_ties: groups left resident because only some of their members could go.
        cross_layer_ties: prefetch only: groups left resident because they span layers,
            and one parameter object cannot point at two layers' buffers.
    """

    offloaded: Mapping[int, LayerChoice]
    offloaded_bytes: int
    split_ties: tuple[StorageGroup, ...]
    cross_layer_ties: tuple[StorageGroup, ...] = ()


NOTHING_SELECTED = Selection(offloaded=MappingProxyType({}), offloaded_bytes=0, split_ties=())


def prefetch_layers(num_layers: int, group_size: int, num_in_group: int) -> tuple[int, ...]:
    """The last `num_in_group` layers of every `group_size` (8 and 2: 6, 7, 14, 15, ...)."""
    return tuple(i for i in range(num_layers) if i % group_size >= group_size - num_in_group)


def _choice(params: tuple[ParamSpec, ...], taken: list[bool]) -> tuple[LayerChoice, int]:
    """The `LayerChoice` of `params` by `taken` (one flag each) and the bytes taken, or
    an empty choice (frozenset()) when nothing is."""
    if all(taken):
        return None, sum(map(_NBYTES, params))
    chosen = [p for p, ok in zip(params, taken, strict=True) if ok]
    return frozenset(p.name for p in chosen), sum(map(_NBYTES, chosen))


def select_prefetch(
    spec: ModelSpec, ties: Sequence[StorageGroup], config: OffloadConfig, on_device: Mapping[str, bool]
) -> Selection:
    """Prefetch: eligible parameters of the layers `prefetch_layers` names.

    Args:
        spec: the model.
        ties: `tied_storages` of the model.
        config: the request (group size, number in group, filter).
        on_device: `devices_on_compute` of the model.
    """
    wanted = prefetch_layers(len(spec.layers), config.group_size, config.num_in_group)
    wanted_set = frozenset(wanted)
    eligible, everything = eligibility(on_device, config)
    # Ties are decided as a whole. One tied across layers would need one buffer per layer,
    # but its parameters (often one Parameter object) can only point at one: it stays.
    tie_taken: dict[Ref, bool] = {}
    primaries: set[Ref] = set()
    split: list[StorageGroup] = []
    across: list[StorageGroup] = []
    for group in ties:
        ok = [layer in wanted_set and eligible(param) for layer, param in group]
        whole = all(ok)
        if whole and any(layer != group[0][0] for layer, _ in group):
            across.append(group)
            whole = False
        elif not whole and any(ok):
            split.append(group)
        for layer, param in group:
            tie_taken[(layer, param.name)] = whole
        primaries.add(group_primary(group))
    tied_layers = {layer for group in ties for layer, _ in group}

    offloaded: dict[int, LayerChoice] = {}
    total = 0
    for index in wanted:
        params = spec.layers[index].params
        if not params:
            continue
        if index in tied_layers:
            taken = [tie_taken.get((index, p.name), None) for p in params]
            flags = [eligible(p) if t is None else t for p, t in zip(params, taken, strict=True)]
            choice, _ = _choice(params, flags)
            # A tied storage counts once, at its first member.
            total += sum(p.nbytes for p, t, ok in zip(params, taken, flags, strict=True)
                         if ok and (t is None or (index, p.name) in primaries))
        elif everything:
            choice = None
            total += sum(map(_NBYTES, params))
        else:
            choice, nbytes = _choice(params, list(map(eligible, params)))
            total += nbytes
        if choice is None or choice:
            offloaded[index] = choice
    return Selection(offloaded=MappingProxyType(offloaded), offloaded_bytes=total, split_ties=tuple(split),
                     cross_layer_ties=tuple(across))


def select_uva(
    spec: ModelSpec, ties: Sequence[StorageGroup], config: OffloadConfig, on_device: Mapping[str, bool]
) -> Selection:
    """UVA: eligible parameters in layer order until `uva_max_bytes` is reached.

    The storage that reaches the budget is taken whole, so the total may cross it.

    Args:
        spec: the model.
        ties: `tied_storages` of the model.
        config: the request (byte budget, filter).
        on_device: `devices_on_compute` of the model.
    """
    budget = config.uva_max_bytes
    eligible, everything = eligibility(on_device, config)
    # A tie is taken (whole) at its first member, if every member is eligible; its other
    # members are then offloaded wherever they are.
    whole_at: dict[Ref, StorageGroup] = {}
    tied_refs: set[Ref] = set()
    split: list[StorageGroup] = []
    for group in ties:
        ok = [eligible(param) for _, param in group]
        if all(ok):
            whole_at[group_primary(group)] = group
        elif any(ok):
            split.append(group)
        tied_refs.update((layer, param.name) for layer, param in group)
    tied_layers = {layer for group in ties for layer, _ in group}

    names: dict[int, set[str]] = {}
    every: set[int] = set()
    total = 0
    for layer in spec.layers:
        if total >= budget:
            break
        index = layer.index
        params = layer.params
        if not params:
            continue
        if everything and index not in tied_layers:
            # Every parameter is eligible: take those that start below the budget.
            sizes = list(map(_NBYTES, params))
            before = list(accumulate(sizes, initial=total))
            count = bisect_left(before, budget, 0, len(sizes))
            if count == len(params):
                every.add(index)
            elif count:
                names.setdefault(index, set()).update(p.name for p in params[:count])
            total = before[count]
            continue
        for param in params:
            if total >= budget:
                break
            ref = (index, param.name)
            if ref in tied_refs:
                whole = whole_at.get(ref)
                if whole is None:
                    continue  # not a first member, or not all members can go
                for member_layer, member in whole:
                    names.setdefault(member_layer, set()).add(member.name)
                total += group_nbytes(whole)
            elif eligible(param):
                names.setdefault(index, set()).add(param.name)
                total += param.nbytes
    offloaded: dict[int, LayerChoice] = {}
    for index in sorted(every | names.keys()):
        offloaded[index] = None if index in every else frozenset(names[index])
    return Selection(offloaded=MappingProxyType(offloaded), offloaded_bytes=total, split_ties=tuple(split))
