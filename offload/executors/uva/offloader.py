"""`UVAOffloader`: the UVA backend's lifecycle (wrap, post_init, new weights, restore,
check), on top of its parts (host views, the on-demand forward: see the package
docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from torch import nn

from offload.errors import ExecutionError
from offload.executors import ops
from offload.executors.common import (
    guard_layers,
    normal_tensors,
    raise_as_execution_error,
    raise_with_progress,
    unguard_layers,
    unpatch_forward,
)
from offload.executors.lifecycle import LEAVES, Lifecycle, require
from offload.executors.live import inspect_params
from offload.executors.ondemand import bind_sites
from offload.executors.placement.find import describe_moves
from offload.executors.placement.marks import claim, mark, unmark
from offload.executors.placement.move import move_all
from offload.executors.placement.restore import (
    Restorer,
    held_storages,
    point_at_host_copies,
    state_dict_hook,
    take_replacements,
)
from offload.executors.placement.unpack import unpack
from offload.executors.reload import Weights, begin_load, log_loaded, write_weights
from offload.executors.uva.forward import OnDemand
from offload.logs import logger
from offload.pure.check import LiveCheck
from offload.pure.plan.revise import revise_plan

__all__ = ["UVAOffloader"]

log = logger("offload.uva")


@final
class UVAOffloader(OnDemand):
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
        unpacked = unpack(layers)  # quantised weights: by their inner tensors (offload.model.wrappers)
        try:
            found, from_host, views = move_all(plan, layers, self._host, self._rt, self._origin, self._data_for)
        except BaseException as exc:
            unpacked.pack()
            self._forget()
            raise_as_execution_error(exc, "moving weights to host memory failed, model left as it was",
                                     "wrap_modules")
        self._restorer = Restorer(layers, self._host, self._origin, from_host, self._rt, views, unpacked)
        self._layers = layers
        self._handle = ops.register_on_demand(self)
        self._hook_on_demand()
        layers_offloaded = sorted({p.layer for p in self._plan.offloaded_params})
        self._hooks = [layers[index].register_state_dict_post_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
            state_dict_hook(self._host, lambda: self._plan, index))
                       for index in layers_offloaded]
        self._hooks += unpacked.hooks(layers, range(len(layers)))  # after the host copies are put in
        mark(layers, self)
        self._state = LEAVES["wrap_modules"]
        log.info("offloaded %d parameters to host memory (%s): %d storages read in place, %d copied on demand "
                 "(moves: %s)", len(self._origin), "pinned" if self._plan.pin.pin else "pageable", len(self._viewed),
                 len(self._data) - len(self._viewed), describe_moves(found))
        return layers

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
        """Log one line of `stats()` (logger ``offload.stats``, INFO) every `steps` forward
        steps and/or every `seconds` seconds (checked at each step; steps are counted only
        where some layer copies on demand); no arguments: stop.

        Raises:
            ExecutionError: `steps` or `seconds` is not a positive number.
        """
        self._step_log.configure(steps, seconds)
