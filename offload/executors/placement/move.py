"""The moves of `wrap_modules`: host admission, host copies made and parameters pointed
at them (meta Parameters replaced), resident weights put on the device, all undone if
anything fails."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref, host_of, torch_dtype
from offload.executors.hoststore import HostStore
from offload.executors.placement.find import Found, ViewGroup, find_moves, view_groups
from offload.executors.placement.progress import Progress, tensor_bytes
from offload.logs import logger
from offload.protocols import Runtime
from offload.pure.decide.admission import HostAdmission, HostFit
from offload.pure.decide.moves import Move, WhereKind, restore_target
from offload.pure.plan.blocks import host_blocks
from offload.pure.plan.plan import OffloadPlan, ParamPlan

log = logger("offload.load")

_HOST = torch.device("cpu")

def admit(plan: OffloadPlan, admission: HostAdmission | None = None) -> None:
    """Refuse a plan whose host memory does not fit the machine, before anything moves.

    Reads the verdict `make_plan` recorded (`OffloadPlan.host_admission`; or `admission`,
    the verdict for the plan with a disk tier: `DiskTierPlan.host_admission`) and obeys
    ``plan.config.host_check``: "refuse" raises, "warn" logs a warning and returns, "off"
    returns. A plan that fits, or whose fit is unknown, always passes.

    Raises:
        ExecutionError: the plan does not fit and host_check is "refuse"; the message has
            the numbers and the limit that binds, ``name`` that limit (``"cgroup"``,
            ``"host_available"``, ``"memlock"``, ``"device"``), ``value`` (bytes needed,
            bytes allowed).
    """
    admission = admission if admission is not None else plan.host_admission
    mode = plan.config.host_check
    if mode == "off" or admission.verdict is not HostFit.DOES_NOT_FIT:
        return
    check = admission.binding_check
    name = admission.binding.value if admission.binding is not None else "host_check"
    value = (check.needed_bytes, check.allowed_bytes) if check is not None else None
    if mode == "refuse":
        raise ExecutionError(
            f"refusing to offload, nothing was moved: the plan {admission.message}. Free memory, offload less, or "
            "pass OffloadConfig(host_check='warn') to offload anyway (the kernel may kill the process)",
            name=name, value=value)
    log.warning("host memory check (host_check='warn', offloading anyway): the plan %s", admission.message)


@final
class Undo:
    """What `wrap_modules` changed, to put back if it fails, last change first."""

    def __init__(self) -> None:
        # ("data", parameter, the data it had or None when that was released after being
        # copied into the host copy of `owner`, owner), or ("param", module, name, the
        # Parameter that was there) where a meta Parameter was replaced.
        self._entries: list[tuple[str, Any, Any, Any]] = []

    def note(self, param: nn.Parameter, move: Move, owner: Ref, *, copied: bool = False) -> None:
        """Before `param.data` changes: remember it (or, for `Move.HOST_TO_PINNED` and
        where `copied` says the host tensor was copied into `owner`'s host copy, that it is
        recovered from there, so that the pageable tensor can go)."""
        recover = move is Move.HOST_TO_PINNED or (copied and move is Move.ADOPT)
        self._entries.append(("data", param, None if recover else param.data, owner))

    def note_replaced(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        """Before ``module._parameters[name]`` is replaced: remember the Parameter there."""
        self._entries.append(("param", module, name, param))

    def run(self, store: HostStore, runtime: Runtime) -> None:
        """Point every parameter back at its data (recovered into pageable host memory
        from its host copy where it was released), and put replaced Parameters back;
        call before releasing the store."""
        recovered: dict[Ref, torch.Tensor] = {}
        for kind, first, second, third in reversed(self._entries):
            if kind == "param":
                first._parameters[second] = third
                continue
            data: torch.Tensor | None = second
            if data is None:
                data = recovered.get(third)
                if data is None:
                    data = recovered[third] = runtime.copy_to(host_of(store, third), _HOST)
            first.data = data
        self._entries.clear()


def assign(layer: nn.Module, name: str, param: nn.Parameter, data: torch.Tensor, *, move: Move, owner: Ref,
           undo: Undo, replaced: dict[int, nn.Parameter], copied: bool = False) -> nn.Parameter:
    """Point parameter `name` of `layer` (now `param`) at `data`, noting it in `undo`
    (`copied`: an adopted host tensor was copied into its host copy, see `Undo.note`).

    A meta Parameter cannot take real data (torch refuses ``param.data = ...`` across
    that boundary), so it is replaced in its module by a new Parameter over `data` of the
    same class, with the same ``requires_grad`` and attributes; names that held the same
    meta Parameter (ties) get the same new one, through `replaced` (``id`` of the old ->
    the new).

    Returns:
        The Parameter that now holds `data` under `name`.
    """
    if param.device.type != "meta" or data.device.type == "meta":
        undo.note(param, move, owner, copied=copied)
        param.data = data
        return param
    new = replaced.get(id(param))
    if new is None:
        # The same Parameter class and attributes (an engine's weight_loader, sharding
        # dims, transformers' flags), over the new data.
        new = torch.Tensor._make_subclass(type(param), data, param.requires_grad)
        new.__dict__.update(param.__dict__)
        replaced[id(param)] = new
    module_name, _, leaf = name.rpartition(".")
    module = layer.get_submodule(module_name) if module_name else layer
    undo.note_replaced(module, leaf, param)
    module._parameters[leaf] = new
    return new


def move_resident(plan: OffloadPlan, layers: Sequence[nn.Module], found: Mapping[Ref, Found], runtime: Runtime,
                  undo: Undo, replaced: dict[int, nn.Parameter],
                  progress: Progress | None = None) -> list[tuple[Ref, nn.Parameter]]:
    """Put the plan's resident parameters that are on the host or meta on the compute device.

    Tied parameters (one storage) get one device tensor. Host tensors are released as the
    parameters stop pointing at them (unless `undo` still needs them: until the wrap ends).

    Returns:
        The parameters copied from the host, with the (layer, name) that owns each
        storage: `restore` gives them back to the host.

    Raises:
        ExecutionError: a device allocation or copy failed (from the runtime).
    """
    placed: dict[Ref, torch.Tensor] = {}
    from_host: list[tuple[Ref, nn.Parameter]] = []
    for p in plan.params:
        if p.offloaded:
            continue
        ref = (p.layer, p.name)
        entry = found.get(ref)
        if entry is None:
            continue
        owner = p.tied_to if p.tied_to is not None and p.tied_to in placed else ref
        data = placed.get(owner)
        source = entry.param.data
        if data is None:
            if entry.move is Move.TO_DEVICE:
                data = runtime.copy_to(source, runtime.device)
            else:
                data = runtime.device_empty(tuple(source.shape), tuple(source.stride()), source.dtype)
            placed[owner] = data
            if progress is not None:
                progress.advance(tensor_bytes(source))
        param = assign(layers[p.layer], p.name, entry.param, data, move=entry.move, owner=owner, undo=undo,
                       replaced=replaced)
        if entry.move is Move.TO_DEVICE:
            from_host.append((owner, param))
    return from_host


#: What an offloaded parameter points at once its storage's host copy exists: given the
#: parameter, the (layer, name) owning the host copy, and the parameter's move.
DataFor = Callable[[ParamPlan, Ref, Move], torch.Tensor]


def reserve_blocks(plan: OffloadPlan, found: Mapping[Ref, Found], store: HostStore) -> int:
    """Reserve in `store` the host blocks of `plan` (`offload.pure.plan.blocks.host_blocks`, for
    the moves found), so that each layer's copies land in one allocation; returns how many.
    Nothing when the store cannot make blocks (`HostStore.blocks_possible`)."""
    if not store.blocks_possible:
        return 0
    moves = {ref: entry.move for ref, entry in found.items()}
    specs = {(p.layer, p.name): p.param for p in plan.params}
    reserved = []
    for block in host_blocks(plan, moves):
        refs = tuple((block.layer, name) for name in block.names)
        likes = tuple(torch.empty_strided(specs[ref].shape, specs[ref].stride, dtype=torch_dtype(specs[ref].dtype),
                                          device="meta") for ref in refs)
        reserved.append((refs, likes, block.offsets))
    store.reserve(reserved)
    return len(reserved)


def move_all(plan: OffloadPlan, layers: Sequence[nn.Module], store: HostStore, runtime: Runtime,
             origin: dict[Ref, torch.device],
             data_for: DataFor, *,
             blocks: bool = False, admission: HostAdmission | None = None,
             ) -> tuple[dict[Ref, Found], list[tuple[Ref, nn.Parameter]], tuple[ViewGroup, ...]]:
    """The moves of `wrap_modules`, shared by the executors: every offloaded storage gets
    its host copy (`HostStore.place`) and each offloaded parameter points at `data_for`
    (the host copy, or a view of it); resident weights go to the device (`move_resident`).

    Args:
        origin: filled with where `restore` puts each offloaded (layer, name).
        blocks: put each layer's copies in one host block where the plan and the store
            allow (`reserve_blocks`; the prefetch backend copies such a layer in one go).
        admission: the verdict `admit` obeys instead of the plan's (a disk tier's).

    Returns:
        What `find_moves` found, the resident parameters copied from the host, and the
        offloaded parameters that are views of one storage (`view_groups`).

    Raises:
        ExecutionError: from `admit`, before anything moved: the plan's host memory does
            not fit and ``config.host_check`` is "refuse".
        PlanError: from `find_moves`, before anything moved.
        BaseException: whatever failed while moving, after every change was undone (the
            caller releases what the store holds and reports the error).
    """
    admit(plan, admission)
    found = find_moves(plan, layers, runtime.device)
    views = view_groups(plan, found)
    if blocks:
        reserve_blocks(plan, found, store)
    undo = Undo()
    replaced: dict[int, nn.Parameter] = {}
    progress = Progress("offloading weights", plan.offloaded_bytes + plan.device_bytes_resident)
    try:
        for p in plan.offloaded_params:
            ref = (p.layer, p.name)
            entry = found[ref]
            if p.tied_to is None:
                store.place(ref, entry.param.data, entry.move)
                progress.advance(p.nbytes, moved=entry.move is not Move.ADOPT or store.in_block(ref))
            owner = p.tied_to or ref
            data = data_for(p, owner, entry.move)
            origin[ref] = restore_place(entry.move, entry.param.device, runtime)
            assign(layers[p.layer], p.name, entry.param, data, move=entry.move, owner=owner, undo=undo,
                   replaced=replaced, copied=store.in_block(owner))
        from_host = move_resident(plan, layers, found, runtime, undo, replaced, progress)
    except BaseException:
        undo.run(store, runtime)
        raise
    progress.finish()
    return found, from_host, views


def restore_place(move: Move, device: torch.device, runtime: Runtime) -> torch.device:
    """The device `restore` puts a weight on, given how it was moved from `device`."""
    if restore_target(move) is WhereKind.HOST:
        return _HOST
    return runtime.device if device.type == "meta" else device
