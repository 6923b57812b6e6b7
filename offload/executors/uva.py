"""`UVAOffloader`: weights in host memory, read in place by the device, or copied to it
for each call of their layer.

It follows the plan and decides nothing. A parameter the plan places UVA points at a
zero-copy device view of its host copy (`Runtime.device_view`): kernels read host memory
over the link, so there are no buffers, no schedule and nothing in flight, and a forward
is plain kernels that a CUDA graph can capture. A parameter placed ON_DEMAND (the plan's
`UvaDecision` is off: the user's switch, no host mapping, pinning off, no CUDA) points at
its host copy, and its layer's forward runs through `torch.func.functional_call` with a
device copy of each such storage, made on the compute stream when the call starts.

Host copies: one per storage (`HostStore`), pinned exactly when ``plan.pin.pin`` says;
tied parameters, within a layer or across layers, share it and the one view of it, so
ties stay ties. If pinning a UVA parameter's copy fails, that copy stays pageable
(counted in `stats().pin_fallbacks`) and, since a pageable copy cannot be viewed, the
parameter is copied on demand instead: the model keeps working.

Lifecycle, as for the prefetch backend: `wrap_modules`, then `post_init` once the weights
are final, then forwards, then `restore`. UVA layers carry no hook and already work after
`wrap_modules`; an on-demand layer that runs before `post_init` raises `ExecutionError`,
because post-processing may have replaced its weights and only `post_init` re-reads them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, final

import torch
from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.executors import ops
from offload.executors.common import (
    Patched,
    Ref,
    current_spec,
    find_parameter,
    first_float_tensor,
    guard_layers,
    host_of,
    host_owner,
    normal_tensors,
    patch_forward,
    profiling,
    raise_as_execution_error,
    raise_with_progress,
    refuse_autograd,
    unguard_layers,
    unpatch_forward,
)
from offload.executors.hoststore import HostSource, HostStore
from offload.executors.lifecycle import LEAVES, Lifecycle, refuse, require
from offload.executors.live import inspect_params
from offload.executors.ondemand import (
    LayerCall,
    LayerCopies,
    Site,
    bind_sites,
    check_capturable,
    copy_layer,
    holder_now,
    on_demand_layers,
    run_swapped,
    run_with,
)
from offload.executors.placement.find import describe_moves
from offload.executors.placement.marks import claim, mark, unmark
from offload.executors.placement.move import move_all
from offload.executors.placement.restore import (
    Restorer,
    held_storages,
    point_at_host_copies,
    resync_data,
    state_dict_hook,
    take_replacements,
)
from offload.executors.reload import (
    Weights,
    begin_load,
    log_loaded,
    refuse_read_only,
    route_state_dict_loads,
    write_weights,
)
from offload.executors.telemetry import StepLog
from offload.model.describe import storage_key
from offload.protocols import Runtime
from offload.pure.check import LiveCheck
from offload.pure.decide.moves import Move
from offload.pure.plan.plan import Backend, OffloadPlan, ParamPlan, Placement
from offload.pure.plan.revise import demote_to_on_demand, revise_plan
from offload.pure.spec.values import ParamSpec
from offload.pure.stats import OffloadStats

__all__ = ["UVAOffloader"]

log = logging.getLogger(__name__)

_RUNS = frozenset({Placement.UVA, Placement.ON_DEMAND})


@final
class UVAOffloader:
    """The UVA backend. Create it with `offload.create_offloader`.

    Args:
        plan: a plan whose backend is uva.
        runtime: the effects to use (`CudaRuntime`, `CpuRuntime`, or a fake).
        host_source: where host copies come from before the runtime is asked
            (`HostSource`, e.g. a segment shared by the processes of one host,
            `offload.sharing`); None: the runtime makes them all.

    Raises:
        PlanError: the plan's backend is not uva, it places a parameter other than UVA
            or ON_DEMAND, or it places one UVA without enabling UVA and pinning.
    """

    def __init__(self, plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None) -> None:
        if plan.backend is not Backend.UVA:
            raise PlanError(f"UVAOffloader runs uva plans, got backend {plan.backend.value}",
                            name="backend", value=plan.backend.value)
        for p in plan.offloaded_params:
            if p.placement not in _RUNS:
                raise PlanError(f"parameter {p.layer}:{p.name} is placed {p.placement.value}; a uva plan places "
                                "parameters uva or on_demand", name=p.name, value=p.placement.value)
            if p.placement is Placement.UVA and not (plan.uva.enabled and plan.pin.pin):
                raise PlanError(f"parameter {p.layer}:{p.name} is placed uva, but the plan has UVA "
                                f"{'on' if plan.uva.enabled else 'off'} and pinning {'on' if plan.pin.pin else 'off'}; "
                                "a zero-copy view needs both", name=p.name, value=p.placement.value)
        self._plan = plan
        self._rt = runtime
        self._state = Lifecycle.NEW
        self._layers: list[nn.Module] = []
        self._host = HostStore(runtime, pin=plan.pin.method, source=host_source)  # owner (layer, name) -> host copy
        self._data: dict[Ref, torch.Tensor] = {}  # owner -> what its parameters point at
        self._viewed: set[Ref] = set()  # owners whose parameters point at a device view
        self._deferred: set[Ref] = set()  # UVA owners loaded after wrapping: viewed at post_init
        self._sources: dict[str, torch.Tensor] = {}  # storage key of a view made here -> its host copy
        self._origin: dict[Ref, torch.device] = {}  # every offloaded (layer, name) -> where restore puts it
        self._restorer: Restorer | None = None
        self._hooks: list[Any] = []  # state_dict hook handles
        self._patched: dict[int, Callable[..., Any] | None] = {}  # layer index -> previous forward attr
        self._on_demand: dict[int, LayerCopies] = {}  # layer -> what it copies per call
        self._sites: dict[int, tuple[Site, ...]] = {}  # layer -> where its copied parameters are (post_init)
        self._running: set[int] = set()  # on-demand layers inside their forward (eager), for re-entry
        self._handle = 0  # for the on-demand op under torch.compile (registered by wrap_modules)
        self._dropped = 0
        self._copies_issued = 0
        self._bytes_copied = 0
        self._steps = 0
        self._first_on_demand: int | None = None  # the layer whose runs count as steps (post_init)
        self._last_on_demand: int | None = None  # the layer whose runs end a step (post_init)
        self._guards: Patched = []  # the other layers' refusing forwards while a restore is unfinished
        # id of a module holding offloaded parameters -> (it, its (key in _parameters,
        # Parameter, owner of its host copy)), for load_state_dict routing (post_init).
        self._held: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, Ref]]]] = {}
        self._load_hooks: list[Any] = []
        self._step_log = StepLog()

    @property
    def plan(self) -> OffloadPlan:
        """The plan being run; after `post_init`, revised for parameters that post-processing
        replaced or deleted; UVA parameters whose pinning fell back are shown ON_DEMAND,
        which is how they run."""
        fallen = {
            (p.layer, p.name)
            for p in self._plan.offloaded_params
            if p.placement is Placement.UVA and (owner := host_owner(p, self._host)) is not None
            and owner not in self._viewed and owner not in self._deferred
        }
        return demote_to_on_demand(self._plan, fallen, "pinning their host copies failed (a view needs pinned memory)")

    # ---- setup ----------------------------------------------------------------------

    @normal_tensors
    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Move every planned parameter to host memory: UVA ones behind a device view,
        on-demand ones with a forward that copies them in per call.

        If anything fails, every parameter already moved is put back (the same Parameter
        objects, bit for bit) and every host copy taken is released.

        Args:
            layers: the model's layers, the same ones (and order) the plan describes.

        Returns:
            The same layers, now offloaded.

        Raises:
            ExecutionError: called twice, or a host copy or view failed (the cause attached).
            PlanError: the layers do not match the plan.
        """
        require(self._state, "wrap_modules")
        layers = list(layers)
        plan = self._plan
        claim(layers, self)
        try:
            found, from_host, views = move_all(plan, layers, self._host, self._rt, self._origin, self._data_for)
        except BaseException as exc:
            self._forget()
            raise_as_execution_error(exc, "moving weights to host memory failed, model left as it was",
                                     "wrap_modules")
        self._restorer = Restorer(layers, self._host, self._origin, from_host, self._rt, views)
        self._layers = layers
        self._handle = ops.register_on_demand(self)
        self._hook_on_demand()
        layers_offloaded = sorted({p.layer for p in self._plan.offloaded_params})
        self._hooks = [layers[index].register_state_dict_post_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
            state_dict_hook(self._host, lambda: self._plan, index))
                       for index in layers_offloaded]
        mark(layers, self)
        self._state = LEAVES["wrap_modules"]
        log.info("offloaded %d parameters to host memory (%s): %d storages read in place, %d copied on demand "
                 "(moves: %s)", len(self._origin), "pinned" if self._plan.pin.pin else "pageable", len(self._viewed),
                 len(self._data) - len(self._viewed), describe_moves(found))
        return layers

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

    def _hook_on_demand(self) -> None:
        """Work out which parameters each layer copies per call; hook layers that need it.

        A module that appears at several places of the stack (``[a, shared, b, shared]``)
        is one set of weights (the plan ties its later places to the first) and one
        forward: it is hooked once, under the first place it has, and copies that place's
        weights whichever place calls it."""
        copies = on_demand_layers(self._plan.offloaded_params, self._host, self._viewed)
        first: dict[int, int] = {}
        for index, module in enumerate(self._layers):
            first.setdefault(id(module), index)
        self._on_demand = {layer: c for layer, c in copies.items() if first[id(self._layers[layer])] == layer}
        for layer in self._on_demand:
            if layer not in self._patched:
                self._patched[layer] = patch_forward(self._layers[layer], functools.partial(self._wrap_forward, layer))

    def _forget(self) -> None:
        """Release every host copy and forget what pointed at them."""
        self._host.clear()
        self._data.clear()
        self._viewed.clear()
        self._deferred.clear()
        self._sources.clear()
        self._origin.clear()

    @normal_tensors
    def post_init(self) -> None:
        """After the weights are final: re-read every planned parameter by name.

        Data that post-processing replaced gets a new host copy, pinned as the plan says,
        and a new view when it is placed UVA; a deleted parameter is dropped and its copy
        released. The plan is revised to match (UVA needs no buffers, so only shapes and
        byte totals change). If it fails, parameters point at valid host copies and it can
        be called again.

        Raises:
            ExecutionError: not called exactly once after `wrap_modules`, or a copy failed.
        """
        require(self._state, "post_init")
        try:
            self._rt.synchronize()  # UVA layers may have run: nothing may read a copy released below
            actual, deleted = self._resync()
            revised = revise_plan(self._plan, actual)
        except BaseException as exc:
            raise_as_execution_error(exc, "post_init failed, weights left in host memory", "post_init")
        for ref in sorted(deleted):
            self._host.drop(ref)
            self._data.pop(ref, None)
            self._viewed.discard(ref)
            log.info("layer %d parameter %r was deleted by post-processing; dropped", *ref)
        try:
            self._attach_deferred()
        except BaseException as exc:
            raise_as_execution_error(exc, "post_init failed making device views, the rest of the weights are "
                                     "copied on demand", "post_init")
        try:
            self._host.release_retired()
        except BaseException as exc:
            raise_as_execution_error(exc, "post_init re-read the weights, but giving back replaced host copies "
                                     "failed (the rest are given back on restore)", "post_init")
        self._dropped += len(deleted)
        self._sources.clear()  # only a re-read needs them, and post_init has succeeded
        if revised is not self._plan:
            log.info("post-processing changed offloaded parameters; plan revised")
        self._plan = revised
        self._hook_on_demand()
        try:
            self._sites = {layer: bind_sites(layer, self._layers[layer], copies, self._host)
                           for layer, copies in self._on_demand.items()}
            self._first_on_demand = min(self._on_demand, default=None)
            self._last_on_demand = max(self._on_demand, default=None)
        except BaseException as exc:
            raise_as_execution_error(exc, "post_init failed finding the on-demand parameters", "post_init")
        self._route_loads()
        self._state = LEAVES["post_init"]

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

    # ---- the forward path -----------------------------------------------------------

    def _wrap_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        call = LayerCall(self._layers[layer], forward)

        def on_demand_forward(*args: Any, **kwargs: Any) -> Any:
            copies = self._copies_of(layer)
            if copies is None:
                return forward(*args, **kwargs)
            if torch.is_grad_enabled():
                refuse_autograd(layer, self._layers[layer], copies.names, args, kwargs)
            if torch.compiler.is_compiling():
                activation = first_float_tensor((*args, *kwargs.values()))
                tensors = ops.copy_on_demand(activation, self._handle, layer)
                return run_with(call, copies, tensors, args, kwargs)
            if layer in self._running:  # the layer called itself: its copies are in place
                return forward(*args, **kwargs)
            sites = self._sites[layer]
            self._check_unchanged(layer, sites)  # data pointers: eager only
            if profiling():
                with torch.profiler.record_function(f"offload.copy on demand layer {layer}"):
                    tensors = self._copy(layer, copies)
            else:
                tensors = self._copy(layer, copies)
            self._running.add(layer)
            try:
                return run_swapped(sites, copies, tensors, forward, args, kwargs)
            finally:
                self._running.discard(layer)

        return on_demand_forward

    def _copies_of(self, layer: int) -> LayerCopies | None:
        if self._state is not Lifecycle.READY:
            refuse(self._state, "forward", f"layer {layer} copies its weights on demand and ran before post_init() "
                   "(post-processing may have replaced them: call post_init() first)", subject=f"layer {layer}")
        return self._on_demand.get(layer)

    def _check_unchanged(self, layer: int, sites: tuple[Site, ...]) -> None:
        """Refuse to run a layer whose copied parameters were replaced or no longer point at
        their host copies (changed after post_init): it would run with the old weights."""
        module = self._layers[layer]
        for name, holder, params, leaf, param, host in sites:
            if (params.get(leaf) is param and param.data_ptr() == host.data_ptr() and param.dtype == host.dtype
                    and holder_now(module, name) is holder):
                continue
            now = params.get(leaf)
            if holder_now(module, name) is not holder:
                what = "the module holding it was replaced"
            elif isinstance(now, torch.Tensor):
                what = f"now {now.dtype}, {tuple(now.shape)}"
            else:
                what = "now gone"
            raise ExecutionError(
                f"layer {layer} parameter {name!r} no longer points at its host copy: it was changed after "
                f"post_init ({what}; e.g. by model.to(), or a tensor assigned to it), and the layer would run "
                "with the old weights. Call restore() first (it keeps the new data), make the change, then "
                "offload again", name=name, value=layer)

    def copies_for(self, layer: int) -> list[torch.Tensor]:
        """Fresh device copies of the host copies `layer` reads on demand, counted in
        `stats()` (`ops.OnDemandTarget`; the eager path calls it directly).

        Raises:
            ExecutionError: not ready, a CUDA graph is being captured from pageable host
                memory, or a copy failed.
        """
        copies = self._copies_of(layer)
        return [] if copies is None else self._copy(layer, copies)

    def _copy(self, layer: int, copies: LayerCopies) -> list[torch.Tensor]:
        if layer == self._first_on_demand:
            self._steps += 1
        if self._rt.is_capturing():
            check_capturable(layer, copies.owners, self._host, self._rt, self._plan.pin)
        tensors, nbytes = copy_layer(copies, self._host, self._rt)
        self._copies_issued += len(tensors)
        self._bytes_copied += nbytes
        if layer == self._last_on_demand and self._step_log.active:
            self._step_log.step(self._steps, self.stats)  # the step's copies are all counted now
        return tensors

    def copy_layouts(self, layer: int) -> list[ops.CopyLayout]:
        """What `copies_for(layer)` returns, as (shape, stride, dtype, device) (for tracing)."""
        copies = self._copies_of(layer)
        device = self._rt.device
        hosts = [host_of(self._host, owner) for owner in (copies.owners if copies is not None else ())]
        return [(tuple(h.shape), tuple(h.stride()), h.dtype, device) for h in hosts]

    # ---- new weights ----------------------------------------------------------------

    @normal_tensors
    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """Give the model new weights without restoring it (`offload.executors.reload`):
        offloaded ones into their host copies, which UVA views read in place and
        on-demand layers copy from at their next call; resident ones and buffers in place.

        Args:
            weights: a mapping of names to tensors, or (name, tensor) pairs; names as
                ``nn.ModuleList(layers).state_dict()`` gives them (``"3.mlp.up.weight"``).
            prefix: what every name starts with (e.g. ``"model.layers."``), stripped.
            skip_read_only: leave out offloaded weights whose host copy this process
                maps read-only (a follower of a sharing group: its leader writes them;
                `SharedOffloader.load_weights` passes it); without it they are refused.

        Raises:
            ExecutionError: the model is not wrapped (or a restore is unfinished), a CUDA
                graph is being captured, or a name, shape or copy is wrong (see
                `write_weights`; a mapping is checked whole before anything is written).
        """
        begin_load(self._state, self._rt)
        loaded = write_weights(weights, self._plan, self._layers, self._host, prefix=prefix,
                                   skip_read_only=skip_read_only)
        log_loaded(loaded)

    # ---- CUDA graphs ----------------------------------------------------------------

    def sync_prev_onload(self) -> None:
        """Nothing to wait for: there is no copy stream. UVA kernels read host memory in
        place, and on-demand copies are queued on the compute stream ahead of the kernels
        that read them, so a capture or replay is ordered by the stream itself.

        Raises:
            ExecutionError: called before `post_init` (the same lifecycle as prefetch).
        """
        require(self._state, "sync_prev_onload")

    def join_after_forward(self) -> None:
        """Nothing to join: no work is forked off the compute stream."""

    # ---- teardown and counters ------------------------------------------------------

    @normal_tensors
    def restore(self) -> None:
        """Put every weight back on its original device with its strides, bit for bit
        (tied storages as one tensor); remove the hooks; release every host copy.

        Raises:
            ExecutionError: nothing to restore (never wrapped, or already restored), or a
                copy back failed (the model is then left offloaded, and restore can be retried).
        """
        require(self._state, "restore")
        try:
            self._rt.synchronize()  # kernels may still read the host copies released below
        except BaseException as exc:
            raise_with_progress(exc, "restore could not wait for the device, nothing restored", "restore")
        restorer = self._restorer
        if restorer is None:
            raise ExecutionError("restore has nothing to give back (wrap_modules did not finish)",
                                 name="state", value=self._state.value)
        # Nothing here may keep a host copy the restorer releases (a view holds its host
        # tensor): parameters point at their host copies, the views go. Until restore
        # finishes the model must not run.
        if self._state is not Lifecycle.RESTORING:
            held = held_storages(self._host, self._data.values())
            take_replacements(self._plan, self._layers, self._host, held, self._rt)
            # From here weights come back one by one: the model must not run until the
            # end (UVA layers have no hook of their own; they get a refusing one).
            self._guards = guard_layers(self._layers, [self._layers[index] for index in self._patched])
            self._state = Lifecycle.RESTORING
        point_at_host_copies(self._plan, self._layers, self._host)
        self._data.clear()
        self._viewed.clear()
        self._sources.clear()
        restorer.run(self._plan)
        for index, previous in self._patched.items():
            unpatch_forward(self._layers[index], previous)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._patched.clear()
        unguard_layers(self._guards)
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []
        self._held = {}
        self._on_demand = {}
        self._sites = {}
        ops.unregister(self._handle)
        self._forget()
        try:
            self._rt.synchronize()  # gives back page-locked memory whose last tensor just died
        except BaseException as exc:
            raise_with_progress(exc, "restore gave every weight back, but waiting for the device failed (call "
                                     "restore() again to finish)", "restore")
        unmark(self._layers)
        self._state = LEAVES["restore"]
        self._restorer = None
        log.info("restored %d parameters (%d storages)", restorer.params, restorer.storages)

    def stats(self) -> OffloadStats:
        """Counters since `wrap_modules`: on-demand copies (UVA reads are not copies), host
        bytes held, pin fallbacks; no device buffers."""
        active = self._state in (Lifecycle.WRAPPED, Lifecycle.READY)
        return OffloadStats(
            params_offloaded=len(self._plan.offloaded_params) if active else 0,
            params_dropped=self._dropped,
            host_bytes=self._host.nbytes,
            device_buffer_bytes=0,
            copies_issued=self._copies_issued,
            bytes_copied=self._bytes_copied,
            wait_seconds=None,
            pin_fallbacks=self._host.fallbacks,
            steps=self._steps,
        )

    def check(self) -> LiveCheck:
        """Where every planned parameter is now: device views for UVA, host copies for on
        demand (see `offload.executors.live`; a UVA weight whose pinning fell back shows as
        a difference: it runs on demand).

        Raises:
            ExecutionError: the model is not wrapped.
        """
        require(self._state, "check")
        views = [self._data[owner] for owner in self._viewed if owner in self._data]
        return inspect_params(self._plan, self._layers, self._rt, ready=self._state is Lifecycle.READY,
                              views=views, hosts=self._host.tensors())

    def log_stats_every(self, steps: int | None = None, seconds: float | None = None) -> None:
        """Log one line of `stats()` (logger ``offload.pure.stats``, INFO) every `steps` forward
        steps and/or every `seconds` seconds (checked at each step; steps are counted only
        where some layer copies on demand); no arguments: stop.

        Raises:
            ExecutionError: `steps` or `seconds` is not a positive number.
        """
        self._step_log.configure(steps, seconds)
