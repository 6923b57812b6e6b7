"""New weights for an offloaded model, without `restore` (`Offloader.load_weights`).

Engines give a running model new weights on purpose: after a reinforcement-learning
update, or when it wakes from sleep. Written the usual way (``load_state_dict``,
``param.copy_()``) they would land in what an offloaded parameter points at: a static
buffer several layers share (prefetch), which the next copy overwrites from the old host
copy. Here each tensor goes where the weight really lives:

- an offloaded parameter: into its host copy, in place (a tie's one copy, so ties stay
  ties; each view of a fused weight into its own copy);
- a disk-tier parameter (`NewCopies`: its host copy lies in a file and is not written in
  place): to the spill file, whose copy replaces the old one; the disk reads come from
  there from then on (`offload.executors.prefetch.disk.DiskStream.replace`);
- a resident parameter or a buffer of the layers: into it, in place.

Nothing is allocated but what torch needs to convert a tensor of another dtype or device
(at most the largest tensor). Values are converted to the weight's dtype, as
``load_state_dict`` converts them; shapes must match. Names are those of the layer stack
the offloader wrapped: ``"<index>.<name in the layer>"``, as ``nn.ModuleList(layers)``
names them (``"3.mlp.up_proj.weight"``), with an optional prefix (``"model.layers."``)
that every name must carry.

The executor waits for the device before the first write (copies and kernels may be
reading the host copies) and afterwards makes its buffers follow (the prefetch backend
issues a step's first copies again); see the executors' ``load_weights``.

``model.load_state_dict(...)`` is routed the same way (`route_state_dict_loads`): each
module that holds offloaded parameters gets a pre-hook that points them at their host
copies while torch copies its entries (so torch's own checks, ``strict`` and messages
apply, and the values land in the host copies), and a post-hook that points them back
and tells the executor its buffers must follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import find_parameter, host_owner, raise_as_execution_error
from offload.executors.hoststore import HostStore
from offload.executors.lifecycle import Lifecycle, require
from offload.executors.placement.progress import Progress
from offload.logs import logger
from offload.protocols import Runtime
from offload.pure.plan.plan import OffloadPlan, ParamPlan
from offload.pure.units import format_bytes

__all__ = ["Loaded", "NewCopies", "Weights", "begin_load", "log_loaded", "refuse_read_only",
           "route_state_dict_loads", "write_weights"]

log = logger("offload.load")

#: What `load_weights` takes: a mapping of names to tensors (a state dict) or an
#: iterable of (name, tensor) pairs (a checkpoint read one tensor at a time).
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class NewCopies(Protocol):
    """Host copies that take new values as a new copy, not in place: the disk tier's,
    which lie in their files (`offload.executors.prefetch.disk.DiskStream`)."""

    def takes(self, ref: tuple[int, str]) -> bool:
        """Whether `ref`'s host copy takes new values this way."""
        ...

    def refusal(self, ref: tuple[int, str]) -> str | None:
        """Why `ref` cannot take new values (for the message that refuses them), or None."""
        ...

    def replace(self, store: HostStore, items: Sequence[tuple[tuple[int, str], torch.Tensor]]) -> None:
        """Give each ref of `items` a new host copy in `store` holding its tensor's values
        (converted as ``copy_`` converts), and read it from there from now on: all of
        them, or (raising `ExecutionError`) none."""
        ...


@attrs.frozen(kw_only=True)
class Loaded:
    """What `write_weights` wrote.

    Attributes:
        host_copies: tensors written into host copies of offloaded parameters.
        in_place: tensors written into resident parameters and buffers.
        skipped: tensors left to the process that writes their shared host copy.
        nbytes: bytes written (of the weights, in their dtype).
    """

    host_copies: int = 0
    in_place: int = 0
    skipped: int = 0
    nbytes: int = 0


@final
@attrs.frozen
class _Target:
    """Where one named tensor goes: `dest` (a host copy or the live tensor), and whether
    it is a host copy; `renew`: the owner of a host copy that takes new values as a new
    copy (`NewCopies`), not in place."""

    name: str
    dest: torch.Tensor | None  # None: left to the process that writes it (`skip_read_only`)
    host: bool
    renew: tuple[int, str] | None = None


def begin_load(state: Lifecycle, runtime: Runtime) -> None:
    """What an executor's ``load_weights`` does before writing: refuse where it cannot
    write, then wait for the device (copies and kernels may read the host copies).

    Raises:
        ExecutionError: the model is not wrapped or a restore is unfinished (`state`), a
            CUDA graph is being captured, or waiting for the device failed (nothing written).
    """
    require(state, "load_weights")
    if runtime.is_capturing():
        raise ExecutionError("load_weights cannot run inside a CUDA graph capture", name="capturing", value=True)
    try:
        runtime.synchronize()
    except BaseException as exc:
        raise_as_execution_error(exc, "load_weights could not wait for the device, nothing written", "load_weights")


def log_loaded(loaded: Loaded) -> None:
    """One line (``offload.load``, INFO) saying what `write_weights` wrote."""
    log.info("load_weights: %d tensors into host copies, %d in place, %d left to the process that writes them (%s)",
             loaded.host_copies, loaded.in_place, loaded.skipped, format_bytes(loaded.nbytes))


def write_weights(weights: Weights, plan: OffloadPlan, layers: Sequence[nn.Module], store: HostStore, *,
                  prefix: str = "", skip_read_only: bool = False, new_copies: NewCopies | None = None) -> Loaded:
    """Write every tensor of `weights` where its weight lives (see the module docstring).

    A mapping is checked whole before anything is written, so a bad name or shape
    changes nothing, and its weights with `new_copies` are written first, all or none
    (a full spill disk leaves the model as it was); pairs from an iterable are checked
    and written one at a time.

    Args:
        weights: names and tensors.
        plan: the plan being run (its offloaded parameters have host copies in `store`).
        layers: the wrapped layers.
        store: the host copies.
        prefix: what every name starts with (stripped before the layer index).
        skip_read_only: leave out (do not refuse) offloaded weights whose host copy this
            process maps read-only: a follower of a sharing group, whose leader writes them;
            and the disk tier's (an engine's loader leaves them to the checkpoint they are
            mapped from).
        new_copies: the host copies that take new values as new copies (the disk tier's);
            None: there are none.

    Returns:
        How many tensors went where (and how many were left to another process), and
        their bytes.

    Raises:
        ExecutionError: a name that is not a parameter or buffer of the layers (or lacks
            `prefix`), a tensor of another shape, on meta, or not a tensor, or a copy that
            failed, or an offloaded weight whose host copy this process maps read-only
            (shared with others: `HostStore.writable`), or a disk-tier weight that cannot
            take new values (no spill directory: `NewCopies.refusal`); ``name`` is the
            tensor's name. A failed write of new copies (a full spill disk: ``name`` is
            ``spill_dir``, ``value`` the error) keeps the old ones. For an iterable, the
            message says how many were written before.
    """
    offloaded = {(p.layer, p.name): p for p in plan.offloaded_params}
    if isinstance(weights, Mapping):
        targets = [(_target(name, tensor, layers, offloaded, store, prefix, skip_read_only, new_copies), tensor)
                   for name, tensor in weights.items()]
        total = sum(_nbytes(tensor) for target, tensor in targets if target.dest is not None)
        # The weights taking new copies first, all or none: nothing else is written if they fail.
        targets.sort(key=lambda item: item[0].renew is None)
        return _write(targets, Progress("loading weights", total), streamed=False, store=store,
                      new_copies=new_copies)
    pairs = ((_target(name, tensor, layers, offloaded, store, prefix, skip_read_only, new_copies), tensor)
             for name, tensor in _pairs(weights))
    return _write(pairs, Progress("loading weights", 0), streamed=True, store=store, new_copies=new_copies)


def _pairs(weights: Iterable[object]) -> Iterable[tuple[object, torch.Tensor]]:
    """The (name, tensor) pairs of `weights`, each checked to be a pair (its parts are
    checked by `_target`)."""
    for index, item in enumerate(weights):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ExecutionError(f"load_weights takes a mapping or (name, tensor) pairs; item {index} is "
                                 f"{type(item).__name__}", name=f"item {index}", value=type(item).__name__)
        yield item[0], item[1]


def _write(targets: Iterable[tuple[_Target, torch.Tensor]], progress: Progress, *, streamed: bool,
           store: HostStore, new_copies: NewCopies | None) -> Loaded:
    host = in_place = skipped = nbytes = 0
    batch: list[tuple[_Target, torch.Tensor]] = []  # a mapping's weights taking new copies, written as one

    def renew(items: Sequence[tuple[_Target, torch.Tensor]]) -> None:
        nonlocal host, nbytes
        if new_copies is None or not items:
            return
        try:
            new_copies.replace(store, [(target.renew, tensor) for target, tensor in items if target.renew is not None])
        except ExecutionError as exc:
            names = ", ".join(repr(target.name) for target, _ in items[:3]) + (", ..." if len(items) > 3 else "")
            raise ExecutionError(f"load_weights: writing the new values of {names} to the spill file failed, they "
                                 f"keep their old ones: {exc}", name=exc.name, value=exc.value) from exc
        for _, tensor in items:
            host += 1
            nbytes += _nbytes(tensor)
            progress.advance(_nbytes(tensor))

    try:
        for target, tensor in targets:
            if target.dest is None:
                skipped += 1
                continue
            if target.renew is not None:
                if streamed:
                    renew([(target, tensor)])
                else:
                    batch.append((target, tensor))
                continue
            renew(batch)
            batch = []
            try:
                with torch.no_grad():
                    target.dest.copy_(tensor)
            except Exception as exc:
                raise ExecutionError(f"load_weights: writing {target.name!r} failed: {exc}", name=target.name,
                                     value=type(exc).__name__) from exc
            host += target.host
            in_place += not target.host
            nbytes += _nbytes(tensor)
            progress.advance(_nbytes(tensor))
        renew(batch)
    except ExecutionError as exc:
        written = host + in_place
        if not streamed and not written:
            raise
        raise ExecutionError(f"{exc} ({written} tensors were written before it, {format_bytes(nbytes)}: the model "
                             "holds their new values and the old ones of the rest)", name=exc.name,
                             value=exc.value) from exc
    progress.finish()
    return Loaded(host_copies=host, in_place=in_place, skipped=skipped, nbytes=nbytes)


def _target(name: object, tensor: object, layers: Sequence[nn.Module], offloaded: Mapping[tuple[int, str], ParamPlan],
            store: HostStore, prefix: str, skip_read_only: bool, new_copies: NewCopies | None) -> _Target:
    """Where `tensor`, named `name`, goes; every check made before anything is written."""
    if not isinstance(name, str):
        raise ExecutionError(f"load_weights: a name must be a str, got {name!r}", name=str(name), value=name)
    if not isinstance(tensor, torch.Tensor):
        raise ExecutionError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a tensor", name=name,
                             value=type(tensor).__name__)
    if tensor.device.type == "meta":
        raise ExecutionError(f"load_weights: {name!r} is on the meta device: it has no values to load", name=name,
                             value="meta")
    where = f"{len(layers)} wrapped layers"
    if not name.startswith(prefix):
        raise ExecutionError(f"load_weights: {name!r} does not start with the prefix {prefix!r}", name=name,
                             value=prefix)
    index_text, _, rest = name[len(prefix):].partition(".")
    if not index_text.isdigit() or not rest or int(index_text) >= len(layers):
        raise ExecutionError(f"load_weights: {name!r} is not {prefix}<layer index>.<name in the layer> of the {where}",
                             name=name, value=index_text)
    layer = int(index_text)
    module = layers[layer]
    entry = offloaded.get((layer, rest))
    dest: torch.Tensor | None
    owner: tuple[int, str] | None = None
    if entry is not None:
        owner = host_owner(entry, store)
        dest = store.get(owner) if owner is not None else None
        if dest is None:
            raise ExecutionError(f"load_weights: {name!r} has no host copy (was it deleted by post-processing?)",
                                 name=name, value=layer)
    else:
        param = find_parameter(module, rest)
        dest = param.data if param is not None else _buffer(module, rest)
        if dest is None:
            raise ExecutionError(f"load_weights: {name!r}: layer {layer} ({type(module).__name__}) has no parameter "
                                 f"or buffer {rest!r}", name=name, value=layer)
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ExecutionError(f"load_weights: {name!r} is {tuple(tensor.shape)}, the model's is {tuple(dest.shape)}",
                             name=name, value=tuple(tensor.shape))
    if entry is not None and owner is not None and not store.writable(owner):
        if skip_read_only:
            return _Target(name=name, dest=None, host=True)
        if new_copies is not None and new_copies.takes(owner):
            refusal = new_copies.refusal(owner)
            if refusal is not None:
                raise ExecutionError(f"load_weights: {name!r} (layer {owner[0]} parameter {owner[1]!r}) cannot take "
                                     f"new weights: {refusal}", name=name, value=owner[0])
            return _Target(name=name, dest=dest, host=True, renew=owner)
        refuse_read_only(store, [owner], "load_weights")
        return _Target(name=name, dest=None, host=True)  # (not reached: refused)
    return _Target(name=name, dest=dest, host=entry is not None)


def refuse_read_only(store: HostStore, owners: Iterable[tuple[int, str]], what: str) -> None:
    """Refuse to write host copies this process may not write (shared read-only by another
    process that wrote them, or read from a file by the disk tier: `HostStore.writable`),
    before anything is written.

    Raises:
        ExecutionError: naming the first such weight (``name`` its name, ``value`` its layer).
    """
    for layer, name in owners:
        if not store.writable((layer, name)):
            raise ExecutionError(f"{what}: layer {layer} parameter {name!r} cannot be written: "
                                 f"{store.read_only_reason((layer, name))}", name=name, value=layer)


def _buffer(module: nn.Module, name: str) -> torch.Tensor | None:
    try:
        found: object = module.get_buffer(name)
    except AttributeError:
        return None
    return found if isinstance(found, torch.Tensor) else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def route_state_dict_loads(holders: Iterable[nn.Module], begin: Callable[[nn.Module], None],
                           end: Callable[[nn.Module], None]) -> list[Any]:
    """Hooks that route ``load_state_dict`` of the offloaded parameters into their host
    copies, wherever the call starts (the model, the stack, a layer or a part of it).

    Args:
        holders: the modules that hold offloaded parameters directly.
        begin: called with a holder before torch copies its entries (the executor points
            the holder's offloaded parameters at their host copies, or refuses).
        end: called with it after its subtree is loaded (they point back).

    Returns:
        The hook handles (``remove()`` each on restore).
    """
    handles: list[Any] = []
    for holder in holders:

        def pre(module: nn.Module, *args: Any) -> None:
            begin(module)

        def post(module: nn.Module, incompatible: Any) -> None:
            end(module)

        handles.append(holder._register_load_state_dict_pre_hook(pre, with_module=True))  # type: ignore[no-untyped-call]  # unannotated in torch
        handles.append(holder.register_load_state_dict_post_hook(post))  # type: ignore[no-untyped-call]  # unannotated in torch
    return handles
