"""Moving weights to where the plan puts them, undoing that on failure, and putting them
back on restore. Shared by every executor; each move is the one `OffloadPlan.move_of`
names for the weight's live device, so no executor decides how a weight travels.

Memory. Weights move one tensor at a time and nothing keeps a second copy of the model:
a pageable host tensor that is offloaded unpinned is adopted as its own host copy; one
that is pinned is copied into page-locked memory and released as soon as the parameter
points at the copy (undo copies it back from there); restore gives each storage back
and releases its host copy before the next. So host memory peaks at the model's bytes
plus its largest tensor (its largest layer, where the prefetch backend puts a layer's
copies in one block: `offload.pure.plan.blocks`), and device memory at the resident weights
(plus buffers) plus the largest tensor, wherever the weights came from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.executors.common import (
    Ref,
    find_parameter,
    host_of,
    host_owner,
    raise_with_progress,
    torch_dtype,
)
from offload.executors.hoststore import HostStore
from offload.model.describe import storage_key
from offload.protocols import Runtime
from offload.pure.decide.admission import HostFit
from offload.pure.decide.moves import Move, WhereKind, restore_target, where_kind
from offload.pure.plan.blocks import host_blocks
from offload.pure.plan.plan import OffloadPlan, ParamPlan
from offload.pure.units import format_bytes

__all__ = [
    "Found",
    "Progress",
    "Restorer",
    "Undo",
    "ViewGroup",
    "OffloadMark",
    "admit",
    "assign",
    "claim",
    "describe_moves",
    "find_moves",
    "mark",
    "move_all",
    "move_resident",
    "point_at_host_copies",
    "reserve_blocks",
    "restore_place",
    "resync_data",
    "state_dict_hook",
    "take_replacements",
    "held_storages",
    "unmark",
    "view_groups",
]

log = logging.getLogger("offload.load")

_HOST = torch.device("cpu")


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


_MARK = "_offload_mark"


@final
class OffloadMark:
    """Set on every layer an offloader has wrapped, until it restores them: a second
    wrap of those layers, by any offloader, is refused by name; so are ``copy.deepcopy``
    and pickling of the model (the copy would point at this offloader's slots and views
    and drive its hooks)."""

    __slots__ = ("owner",)

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __deepcopy__(self, memo: object) -> OffloadMark:
        raise ExecutionError(
            f"cannot deepcopy an offloaded model (its layers are wrapped by {self.owner}): the copy would share "
            "its offloader's slots and hooks; deepcopy before offloading, or call restore() first",
            name="deepcopy", value=self.owner)

    def __reduce__(self) -> Any:
        raise ExecutionError(
            f"cannot pickle an offloaded model (its layers are wrapped by {self.owner}): save its state_dict(), "
            "which holds the real weights, or call restore() first", name="pickle", value=self.owner)

    def __repr__(self) -> str:
        return f"OffloadMark({self.owner})"


def admit(plan: OffloadPlan) -> None:
    """Refuse a plan whose host memory does not fit the machine, before anything moves.

    Reads the verdict `make_plan` recorded (`OffloadPlan.host_admission`) and obeys
    ``plan.config.host_check``: "refuse" raises, "warn" logs a warning and returns, "off"
    returns. A plan that fits, or whose fit is unknown, always passes.

    Raises:
        ExecutionError: the plan does not fit and host_check is "refuse"; the message has
            the numbers and the limit that binds, ``name`` that limit (``"cgroup"``,
            ``"host_available"``, ``"memlock"``, ``"device"``), ``value`` (bytes needed,
            bytes allowed).
    """
    admission = plan.host_admission
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


def point_at_host_copies(plan: OffloadPlan, layers: Sequence[nn.Module], store: HostStore) -> None:
    """Point every offloaded parameter that still exists at the host copy behind it."""
    for p in plan.offloaded_params:
        param = find_parameter(layers[p.layer], p.name)
        owner = host_owner(p, store)
        host = store.get(owner) if owner is not None else None
        if param is not None and host is not None:
            param.data = host


def claim(layers: Sequence[nn.Module], owner: object) -> None:
    """Refuse layers another offloader has wrapped and not restored (before anything moves).

    Raises:
        ExecutionError: naming the layer and the offloader holding it.
    """
    for index, layer in enumerate(layers):
        mark = getattr(layer, "__dict__", {}).get(_MARK)
        if isinstance(mark, OffloadMark):
            raise ExecutionError(
                f"layers[{index}] ({type(layer).__name__}) is already offloaded by {mark.owner}; restore() that "
                "offloader first (a second one would copy its shared slots: another layer's weights)",
                name=f"layers[{index}]", value=mark.owner)


def mark(layers: Sequence[nn.Module], owner: object) -> None:
    """Mark `layers` as wrapped by `owner` (see `OffloadMark`)."""
    tag = OffloadMark(f"{type(owner).__name__}@{id(owner):#x}")
    for layer in layers:
        # First in the instance dict, so that pickling meets the mark before the hooks
        # (local functions, which pickle would refuse with a less helpful error).
        rest = {k: v for k, v in layer.__dict__.items() if k != _MARK}
        layer.__dict__.clear()
        layer.__dict__[_MARK] = tag
        layer.__dict__.update(rest)


def unmark(layers: Sequence[nn.Module]) -> None:
    """Take the marks off again (restore)."""
    for layer in layers:
        layer.__dict__.pop(_MARK, None)


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@final
class Progress:
    """Logs how far a long move has got (bytes, GB/s) on the ``offload.load`` logger, at
    most once every `every` seconds, and once at the end (`total_bytes` 0: not known)."""

    def __init__(self, what: str, total_bytes: int, *, every: float = 2.0) -> None:
        self._what = what
        self._total = total_bytes
        self._done = 0
        self._kept = 0
        self._every = every
        self._start = self._last = time.monotonic()

    def advance(self, nbytes: int, *, moved: bool = True) -> None:
        """`nbytes` more are done: copied or allocated, or (``moved=False``) used where
        they are, which takes no time and is reported apart."""
        if not moved:
            self._kept += nbytes
            return
        self._done += nbytes
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            if self._total:
                log.info("%s: %s of %s (%.2f GB/s)", self._what, format_bytes(self._done), format_bytes(self._total),
                         self._rate(now))
            else:  # the total is not known beforehand (weights read one at a time)
                log.info("%s: %s so far (%.2f GB/s)", self._what, format_bytes(self._done), self._rate(now))

    def finish(self) -> None:
        """Log the total."""
        now = time.monotonic()
        kept = f"; {format_bytes(self._kept)} used in place" if self._kept else ""
        if self._done:
            log.info("%s: %s in %.2f s (%.2f GB/s)%s", self._what, format_bytes(self._done), now - self._start,
                     self._rate(now), kept)
        elif self._kept:
            log.info("%s: nothing to copy%s", self._what, kept)

    def _rate(self, now: float) -> float:
        return self._done / max(now - self._start, 1e-9) / 1e9


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
                progress.advance(_nbytes(source))
        param = assign(layers[p.layer], p.name, entry.param, data, move=entry.move, owner=owner, undo=undo,
                       replaced=replaced)
        if entry.move is Move.TO_DEVICE:
            from_host.append((owner, param))
    return from_host


#: What an offloaded parameter points at once its storage's host copy exists: given the
#: parameter, the (layer, name) owning the host copy, and the parameter's move.
DataFor = Callable[[ParamPlan, Ref, Move], torch.Tensor]


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
             blocks: bool = False) -> tuple[dict[Ref, Found], list[tuple[Ref, nn.Parameter]], tuple[ViewGroup, ...]]:
    """The moves of `wrap_modules`, shared by the executors: every offloaded storage gets
    its host copy (`HostStore.place`) and each offloaded parameter points at `data_for`
    (the host copy, or a view of it); resident weights go to the device (`move_resident`).

    Args:
        origin: filled with where `restore` puts each offloaded (layer, name).
        blocks: put each layer's copies in one host block where the plan and the store
            allow (`reserve_blocks`; the prefetch backend copies such a layer in one go).

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
    admit(plan)
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


@final
class Restorer:
    """Gives weights back one storage at a time, remembering what is done, so that a
    restore that fails half way can be retried and finishes the rest.

    Args:
        layers: the layers being run.
        store: the host copies.
        target: for every offloaded (layer, name), the device its data goes back to.
        from_host: resident parameters `move_resident` copied from the host.
        runtime: the effects.
        views: offloaded parameters that were views of one storage: given back into one
            storage again (bytes no parameter covered are not kept).
    """

    def __init__(self, layers: Sequence[nn.Module], store: HostStore, target: Mapping[Ref, torch.device],
                 from_host: Sequence[tuple[Ref, nn.Parameter]], runtime: Runtime,
                 views: Sequence[ViewGroup] = ()) -> None:
        self._views = views
        self._reshared = False
        self._layers = layers
        self._store = store
        self._target = target
        self._from_host = from_host
        self._rt = runtime
        self._groups: dict[Ref, list[nn.Parameter]] | None = None
        self._done: set[Ref] = set()
        self._resident_done: set[int] = set()
        # Host tensors already given to resident storages, by owner: kept across runs, so
        # that names sharing a storage get the one tensor even when a failed run had given
        # it to only some of them (a tie across layers is not contiguous in `from_host`).
        self._back: dict[Ref, torch.Tensor] = {}
        self.params = 0
        self.storages = 0

    @property
    def started(self) -> bool:
        """Whether `run` has been called (a retry finishes what it began)."""
        return self._groups is not None

    def run(self, plan: OffloadPlan) -> None:
        """Give every weight `plan` offloads back; skip what an earlier, failed run already
        gave back.

        Raises:
            ExecutionError: a copy failed; what is done stays done, the rest stays where
                it was (offloaded weights in their host copies), and `run` can be called
                again. The message says how far it got.
        """
        if self._groups is None:
            self._groups = self._group(plan.offloaded_params)
        groups = self._groups
        total = len(groups) + len({owner for owner, _ in self._from_host})  # storages, ties once
        progress = Progress("restoring weights", sum(_nbytes(host_of(self._store, o)) for o in groups
                                                      if o not in self._done))
        try:
            for owner, members in groups.items():
                if owner in self._done:
                    continue
                host = host_of(self._store, owner)
                dest = self._target[owner]
                if dest.type == "cpu" and not self._rt.is_pinned(host):
                    data = host  # already a pageable host tensor: it is the weight
                else:
                    data = self._rt.copy_to(host, dest)
                for param in members:
                    param.data = data
                self._done.add(owner)  # before the release: if that fails, a retry goes on from here
                self.params += len(members)
                self.storages += 1
                progress.advance(_nbytes(host))
                self._store.drop(owner)
            self._resident_back()
            self._reshare()
        except BaseException as exc:
            done = len(self._done) + len(self._back)
            raise_with_progress(
                exc, f"restore stopped after giving back {done} of {total} storages (the rest are still "
                "offloaded; call restore() again to finish)", "restore")
        progress.finish()

    def _group(self, params: Iterable[ParamPlan]) -> dict[Ref, list[nn.Parameter]]:
        """Live parameters by the (layer, name) whose host copy holds their data."""
        groups: dict[Ref, list[nn.Parameter]] = {}
        for p in params:
            param = find_parameter(self._layers[p.layer], p.name)
            if param is None:
                continue
            owner = host_owner(p, self._store)
            if owner is None:
                raise ExecutionError(f"no host copy for layer {p.layer} parameter {p.name!r}",
                                     name=p.name, value=p.layer)
            groups.setdefault(owner, []).append(param)
        return groups

    def _reshare(self) -> None:
        """Put parameters that were views of one storage back into one storage."""
        if self._reshared:
            return
        for nbytes, members in self._views:
            params = [(find_parameter(self._layers[ref[0]], ref[1]), offset) for ref, offset in members]
            live = [(param, offset) for param, offset in params if param is not None]
            if len(live) < 2 or len({param.untyped_storage().data_ptr() for param, _ in live}) == 1:
                continue  # fewer than two left, or still one storage (given back in place)
            device = live[0][0].device
            base = (self._rt.device_empty((nbytes,), (1,), torch.uint8) if device == self._rt.device
                    else torch.empty(nbytes, dtype=torch.uint8, device=device))
            for param, offset in live:
                view = torch.empty(0, dtype=param.dtype, device=device).set_(
                    base.untyped_storage(), offset, tuple(param.shape), tuple(param.stride()))
                view.copy_(param.data)
                param.data = view
        self._reshared = True

    def _resident_back(self) -> None:
        """Resident parameters that came from the host go back there (ties as one tensor)."""
        back = self._back
        for index, (owner, param) in enumerate(self._from_host):
            if index in self._resident_done:
                continue
            data = back.get(owner)
            if data is None:
                data = back[owner] = self._rt.copy_to(param.data, _HOST)
            param.data = data
            self._resident_done.add(index)


def describe_moves(found: Mapping[Ref, Found]) -> str:
    """``"3 to_host, 2 adopt"``: how many parameters each move took, for the log."""
    counts: dict[Move, int] = {}
    for entry in found.values():
        counts[entry.move] = counts.get(entry.move, 0) + 1
    return ", ".join(f"{n} {m.value}" for m, n in sorted(counts.items(), key=lambda item: item[0].value)) or "none"


def resync_data(plan: OffloadPlan, p: ParamPlan, data: torch.Tensor, store: HostStore, runtime: Runtime,
                *, defer_release: bool = False) -> torch.Tensor:
    """The host copy of `p` for data a loader or post-processing put in its place (at
    `post_init`), made as `OffloadPlan.move_of` says for the data's device.

    Raises:
        ExecutionError: the data is on meta (its weights were never loaded), or the
            runtime failed.
    """
    if data.device.type == "meta":
        raise ExecutionError(
            f"layer {p.layer} parameter {p.name!r} is still on the meta device at post_init: its weights "
            "were never loaded (write them into param.data, or assign a tensor, before post_init)",
            name=p.name, value=p.layer,
        )
    move = plan.move_of(p, str(data.device), str(runtime.device))
    return store.place((p.layer, p.name), data, move, defer_release=defer_release)


def take_replacements(plan: OffloadPlan, layers: Sequence[nn.Module], store: HostStore, ours: set[int],
                      runtime: Runtime) -> int:
    """Before a restore: a parameter whose data is no longer what the executor gave it
    (storage not among `ours`: host copies, slots, views) was replaced by its user — a
    loader after `wrap_modules`, post-processing before a failed `post_init`. Its data
    becomes its host copy, so that restore gives back the new weights, not the old ones.

    Returns:
        How many parameters were replaced.

    Raises:
        ExecutionError: a parameter was replaced by a meta tensor (nothing to give back);
            nothing has changed, and restore can be called again once it holds data.
    """
    replaced: list[tuple[ParamPlan, nn.Parameter]] = []
    for p in plan.offloaded_params:
        param = find_parameter(layers[p.layer], p.name)
        if param is None or param.numel() == 0:
            continue
        if param.device.type == "meta":
            raise ExecutionError(
                f"layer {p.layer} parameter {p.name!r} was replaced by a meta tensor: restore cannot give it back; "
                "nothing was restored (give it data and call restore() again)", name=p.name, value=p.layer)
        if param.untyped_storage().data_ptr() not in ours:
            replaced.append((p, param))
    for p, param in replaced:
        resync_data(plan, p, param.data, store, runtime)
        log.info("layer %d parameter %r was replaced after wrapping: restore gives back its new data", p.layer, p.name)
    return len(replaced)


def held_storages(store: HostStore, *others: Iterable[torch.Tensor]) -> set[int]:
    """The storage addresses of every host copy in `store` and of `others`."""
    tensors = [t for ref in store if (t := store.get(ref)) is not None]
    return {t.untyped_storage().data_ptr() for group in (tensors, *others) for t in group if t.numel()}


StateDictHook = Callable[[nn.Module, dict[str, Any], str, Any], None]


def state_dict_hook(store: HostStore, plan_of: Callable[[], OffloadPlan], layer: int) -> StateDictHook:
    """A ``register_state_dict_post_hook`` hook for offloaded `layer`: each offloaded
    parameter's entry becomes its host copy, which holds its real values (a prefetch
    parameter points at a shared slot that holds whichever layer ran last)."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for p in plan_of().offloaded_params:
            if p.layer != layer:
                continue
            key = prefix + p.name
            owner = host_owner(p, store)
            host = store.get(owner) if owner is not None else None
            if key in state_dict and host is not None:
                state_dict[key] = host.detach()

    return hook
