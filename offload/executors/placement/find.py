"""The plan matched to the live layers before anything moves: each planned parameter
with its live Parameter and its move, the ties checked, and the view groups found."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
from torch import nn

from offload.errors import PlanError
from offload.executors.common import Ref, find_parameter
from offload.model.describe import storage_key
from offload.pure.decide.moves import Move, WhereKind, where_kind
from offload.pure.plan.plan import OffloadPlan


@attrs.frozen(eq=False)
class Found:
    """A planned parameter as it is now: the live Parameter and how it reaches its place."""

    param: nn.Parameter
    move: Move


def find_moves(plan: OffloadPlan, layers: Sequence[nn.Module], device: torch.device) -> dict[Ref, Found]:
    """Match the plan to the live layers before anything moves.

    Args:
        plan: the plan.
        layers: the layers it was made for.
        device: the runtime's compute device.

    Returns:
        Every offloaded (layer, name), and every resident one that has to move (from the
        host or meta to the device), with its live parameter and move.

    Raises:
        PlanError: the layers are not the ones the plan was made for (count, a missing
            parameter, another shape, stride or dtype), or an offloaded parameter is on a
            device that is neither the runtime's, the host, nor meta; the message names
            the parameter and the difference.
    """
    if len(layers) != plan.num_layers:
        raise PlanError(f"the plan is for {plan.num_layers} layers, got {len(layers)}",
                        name="layers", value=len(layers))
    for layer_index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise PlanError(f"layers[{layer_index}] is a {type(layer).__name__}, not an nn.Module",
                            name=f"layers[{layer_index}]", value=layer)
    compute = str(device)
    found: dict[Ref, Found] = {}
    for p in plan.params:
        where = f"layer {p.layer} parameter {p.name!r}"
        param = find_parameter(layers[p.layer], p.name)
        if param is None:
            if p.offloaded:
                raise PlanError(f"{where} is in the plan but not in the layer", name=p.name, value=p.layer)
            continue
        live = str(param.device)
        if p.offloaded:
            got = (tuple(param.shape), tuple(param.stride()), str(param.dtype).removeprefix("torch."))
            want = (p.shape, p.stride, p.dtype)
            if got != want:
                raise PlanError(f"{where} is (shape, stride, dtype) {got}, the plan says {want}",
                                name=p.name, value=got)
            if where_kind(live, compute) is WhereKind.OTHER:
                raise PlanError(f"{where} is on {live}; it can be offloaded from the runtime's device {compute}, "
                                "from host memory or from meta", name=p.name, value=live)
        move = plan.move_of(p, live, compute)
        if p.offloaded or move is not Move.KEEP:
            found[(p.layer, p.name)] = Found(param=param, move=move)
    _check_ties(plan, found)
    return found


def _check_ties(plan: OffloadPlan, found: Mapping[Ref, Found]) -> None:
    """The plan's ties hold in the live model, and the model has no tie among offloaded
    parameters that the plan does not know (either would leave one name with another's
    weights, or two copies of one weight).

    Raises:
        PlanError: naming the two parameters and which side has the tie.
    """
    owner_of: dict[object, Ref] = {}
    for p in plan.offloaded_params:
        ref = (p.layer, p.name)
        entry = found.get(ref)
        if entry is None:
            continue
        key: object = storage_key(entry.param) or ("untied", ref)
        if p.tied_to is not None:
            tied = found.get(p.tied_to)
            if tied is not None and (storage_key(tied.param) or ("untied", p.tied_to)) != key:
                raise PlanError(
                    f"layer {p.layer} parameter {p.name!r} is tied to layer {p.tied_to[0]} parameter "
                    f"{p.tied_to[1]!r} in the plan, but in the model they hold separate data; plan again from this "
                    "model", name=p.name, value=p.tied_to)
            continue
        first = owner_of.setdefault(key, ref)
        if first != ref:
            raise PlanError(
                f"layer {p.layer} parameter {p.name!r} and layer {first[0]} parameter {first[1]!r} share one "
                "storage in the model, but the plan treats them as separate; plan again from this model",
                name=p.name, value=first)


#: Offloaded parameters that are different views of one storage (a fused weight split
#: into slices): the storage's bytes, and each member with its storage offset in elements.
ViewGroup = tuple[int, tuple[tuple[Ref, int], ...]]


def view_groups(plan: OffloadPlan, found: Mapping[Ref, Found]) -> tuple[ViewGroup, ...]:
    """Offloaded parameters sharing one storage as different views (not ties: those are
    one view under two names). Their host copies are separate; restore puts them back
    into one storage again (`Restorer`)."""
    by_storage: dict[tuple[str, int], list[tuple[Ref, nn.Parameter]]] = {}
    for p in plan.offloaded_params:
        if p.tied_to is not None:
            continue
        entry = found.get((p.layer, p.name))
        if entry is None or entry.param.device.type == "meta" or entry.param.numel() == 0:
            continue
        storage = entry.param.untyped_storage()
        by_storage.setdefault((str(entry.param.device), storage.data_ptr()), []).append(((p.layer, p.name), entry.param))
    groups: list[ViewGroup] = []
    for members in by_storage.values():
        if len(members) > 1:
            nbytes = members[0][1].untyped_storage().nbytes()
            groups.append((nbytes, tuple((ref, int(param.storage_offset())) for ref, param in members)))
    return tuple(groups)


def describe_moves(found: Mapping[Ref, Found]) -> str:
    """``"3 to_host, 2 adopt"``: how many parameters each move took, for the log."""
    counts: dict[Move, int] = {}
    for entry in found.values():
        counts[entry.move] = counts.get(entry.move, 0) + 1
    return ", ".join(f"{n} {m.value}" for m, n in sorted(counts.items(), key=lambda item: item[0].value)) or "none"
