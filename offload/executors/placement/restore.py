"""Giving weights back: one storage at a time, retryable (`Restorer`), with the
parameters a user replaced after wrapping taken first, and the state_dict hook that
shows host copies rather than shared slots."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, final

import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref, find_parameter, host_of, host_owner, raise_with_progress
from offload.executors.hoststore import HostStore
from offload.executors.placement.find import ViewGroup
from offload.executors.placement.progress import Progress, tensor_bytes
from offload.executors.placement.unpack import Unpacked
from offload.logs import logger
from offload.protocols import Runtime
from offload.pure.plan.plan import OffloadPlan, ParamPlan

log = logger("offload.load")

_HOST = torch.device("cpu")

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
        unpacked: quantised weights unpacked into their inner tensors: packed again once
            every inner tensor is back.
    """

    def __init__(self, layers: Sequence[nn.Module], store: HostStore, target: Mapping[Ref, torch.device],
                 from_host: Sequence[tuple[Ref, nn.Parameter]], runtime: Runtime,
                 views: Sequence[ViewGroup] = (), unpacked: Unpacked | None = None) -> None:
        self._views = views
        self._unpacked = unpacked
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
        progress = Progress("restoring weights", sum(tensor_bytes(host_of(self._store, o)) for o in groups
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
                progress.advance(tensor_bytes(host))
                self._store.drop(owner)
            self._resident_back()
            self._reshare()
            if self._unpacked is not None:
                self._unpacked.pack()
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


def point_at_host_copies(plan: OffloadPlan, layers: Sequence[nn.Module], store: HostStore) -> None:
    """Point every offloaded parameter that still exists at the host copy behind it."""
    for p in plan.offloaded_params:
        param = find_parameter(layers[p.layer], p.name)
        owner = host_owner(p, store)
        host = store.get(owner) if owner is not None else None
        if param is not None and host is not None:
            param.data = host


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
