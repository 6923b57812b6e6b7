"""The host copies a UVA offloader's parameters point at, and the device views of them:
made once per storage (ties stay ties), views made at post_init for weights a loader
wrote after wrapping, replaced data re-read, and ``load_state_dict`` routed past the
views into the host copies (a view's writes would be device writes of host memory)."""

from __future__ import annotations

import torch
from torch import nn

from offload.executors.common import Ref, current_spec, find_parameter, host_of, host_owner
from offload.executors.lifecycle import Lifecycle
from offload.executors.placement.restore import resync_data
from offload.executors.reload import refuse_read_only, route_state_dict_loads
from offload.executors.uva.state import UVAState
from offload.model.describe import storage_key
from offload.pure.decide.moves import Move
from offload.pure.plan.plan import ParamPlan, Placement
from offload.pure.spec.values import ParamSpec

__all__ = ["HostViews"]


class HostViews(UVAState):
    """Host copies, device views, re-reads and routed loads."""

    def _data_for(self, p: ParamPlan, owner: Ref, move: Move) -> torch.Tensor:
        """What `p` points at after wrapping (see `_attach`)."""
        if move is Move.NEW_ON_HOST and p.placement is Placement.UVA:
            # A loader will write these weights: into the host copy itself, not through a
            # device view of it (a host-to-device copy whose destination is host memory is
            # outside what CUDA defines); post_init attaches the view.
            data = self._data.setdefault(owner, host_of(self._host, owner))
            self._deferred.add(owner)
            return data
        return self._attach(p, owner)

    def _attach(self, p: ParamPlan, owner: Ref) -> torch.Tensor:
        """What the parameters sharing `owner`'s host copy point at, made once per owner: a
        device view for UVA (an empty device tensor when there is nothing to view), else
        the host copy (on demand, or UVA whose pinning fell back)."""
        data = self._data.get(owner)
        if data is not None:
            return data
        host = host_of(self._host, owner)
        if p.placement is Placement.UVA and host.numel() == 0:
            data = self._rt.device_empty(tuple(host.shape), tuple(host.stride()), host.dtype)
            self._viewed.add(owner)
        elif p.placement is Placement.UVA and self._rt.is_pinned(host):
            data = self._rt.device_view(host)
            self._viewed.add(owner)
            key = storage_key(data)
            if key is not None:
                self._sources[key] = host
        else:
            data = host
        self._data[owner] = data
        return data

    def _attach_deferred(self) -> None:
        """Point the parameters of owners loaded after wrapping (still in their host copy,
        not replaced since) at a device view of it."""
        owners = {o for o in self._deferred if (host := self._host.get(o)) is not None and self._data.get(o) is host}
        self._deferred.clear()
        for owner in owners:
            del self._data[owner]
        for p in self._plan.offloaded_params:
            held = host_owner(p, self._host)
            if held is not None and held in owners:
                param = find_parameter(self._layers[p.layer], p.name)
                if param is not None:
                    param.data = self._attach(p, held)

    def _forget(self) -> None:
        """Release every host copy and forget what pointed at them."""
        self._host.clear()
        self._data.clear()
        self._viewed.clear()
        self._deferred.clear()
        self._sources.clear()
        self._origin.clear()

    def _resync(self) -> tuple[dict[Ref, ParamSpec | None], set[Ref]]:
        """Re-copy replaced data (old copies retired, not released: other parameters may
        still point at them until they are re-read too); report what each parameter is."""
        actual: dict[Ref, ParamSpec | None] = {}
        deleted: set[Ref] = set()
        for p in self._plan.offloaded_params:
            ref = (p.layer, p.name)
            param = find_parameter(self._layers[p.layer], p.name)
            if param is None:
                actual[ref] = None
                deleted.add(ref)
                continue
            owner = host_owner(p, self._host)
            expected = None if owner is None or owner in deleted else self._data.get(owner)
            key = storage_key(param.data)
            if expected is None or key is None or key != storage_key(expected):
                # Replaced, or its owner was deleted: its own copy, read from the host copy
                # behind it when it is one of our views (no device read of host memory).
                source = self._sources.get(key) if key is not None else None
                resync_data(self._plan, p, param.data if source is None else source, self._host, self._rt,
                            defer_release=True)
                self._data.pop(ref, None)
                self._viewed.discard(ref)
                param.data = self._attach(p, ref)
            actual[ref] = current_spec(p, param.data)
        return actual, deleted

    def _route_loads(self) -> None:
        """Route ``load_state_dict`` of the offloaded parameters into their host copies
        (`route_state_dict_loads`): a view's writes would be device writes of host memory."""
        held: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, Ref]]]] = {}
        for p in self._plan.offloaded_params:
            owner = host_owner(p, self._host)
            param = find_parameter(self._layers[p.layer], p.name)
            if owner is None or param is None:
                continue
            prefix, _, leaf = p.name.rpartition(".")
            holder = self._layers[p.layer].get_submodule(prefix) if prefix else self._layers[p.layer]
            held.setdefault(id(holder), (holder, []))[1].append((leaf, param, owner))
        self._held = held
        self._load_hooks = route_state_dict_loads((h for h, _ in held.values()), self._route_begin, self._route_end)

    def _route_begin(self, holder: nn.Module) -> None:
        """``load_state_dict`` reaches `holder`: its parameters that point at a device view
        point at the host copy behind it while torch writes (on-demand ones do already)."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return
        live = [(param, owner) for leaf, param, owner in entry[1] if holder._parameters.get(leaf) is param]
        refuse_read_only(self._host, (owner for _, owner in live), "load_state_dict")
        self._rt.synchronize()  # kernels may be reading the host copies about to be written
        for param, owner in live:
            if owner in self._viewed:
                param.data = host_of(self._host, owner)

    def _route_end(self, holder: nn.Module) -> None:
        """`holder`'s part of ``load_state_dict`` is done: views are pointed at again."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return
        for leaf, param, owner in entry[1]:
            view = self._data.get(owner)
            if (owner in self._viewed and view is not None and holder._parameters.get(leaf) is param
                    and param.data_ptr() == host_of(self._host, owner).data_ptr()):
                param.data = view
