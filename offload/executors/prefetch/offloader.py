"""`PrefetchOffloader`: the prefetch backend's lifecycle (wrap, post_init, restore, check),
on top of its parts (the copy queue, the forwards, new weights: see the package docstring
and its notes).

It follows the plan and decides nothing: which parameters, pinned or not, which slot,
which copy after which layer all come from the `OffloadPlan`. Effects go through the
injected `Runtime`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors import ops
from offload.executors.common import (
    Ref,
    current_spec,
    find_parameter,
    guard_layers,
    normal_tensors,
    patch_forward,
    raise_as_execution_error,
    raise_with_progress,
    torch_dtype,
    unguard_layers,
    unpatch_forward,
)
from offload.executors.experts import ExpertCaches
from offload.executors.lifecycle import LEAVES, Lifecycle, require
from offload.executors.live import inspect_params
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
from offload.executors.placement.unpack import unpack
from offload.executors.prefetch.buffers import allocate_arenas, merge_copies, prepare_copies
from offload.executors.prefetch.weights import NewWeights
from offload.executors.reload import route_state_dict_loads
from offload.logs import logger
from offload.model.describe import storage_key
from offload.pure.check import LiveCheck
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.plan.layout import owns_buffer
from offload.pure.plan.plan import OffloadPlan, ParamPlan
from offload.pure.plan.revise import revise_plan
from offload.pure.spec.values import ParamSpec

__all__ = ["PrefetchOffloader"]

log = logger("offload.prefetch")


@final
class PrefetchOffloader(NewWeights):
    """The prefetch backend. Create it with `offload.create_offloader`.

    Args:
        plan: a plan whose backend is prefetch.
        runtime: the effects to use (`CudaRuntime`, `CpuRuntime`, or a fake).
        host_source: where host copies come from before the runtime is asked
            (`HostSource`, e.g. a segment shared by the processes of one host,
            `offload.sharing`); None: the runtime makes them all.
        disk: the plan's disk tier (`offload.pure.disk.plan_disk_tier`): its layers are
            read from disk into a ring of staging buffers ahead of their copies (Note
            [disk tier]); None: every offloaded weight in host memory.
        spill_dir: with `disk`, where weights not read from the checkpoint as they lie
            are written once (a spill file, unlinked once open).
        disk_io: with `disk`, how it reads and spills (`DiskIO`: tests inject failures).

    Raises:
        PlanError: the plan's backend is not prefetch, or `disk` is not this plan's tier
            (or comes with `host_source`).
        ExecutionError: `disk` spills weights and no `spill_dir` is given.
    """

    @property
    def disk_tier(self) -> DiskTierPlan | None:
        """The disk tier being run (Note [disk tier]), or None."""
        return self._disk.tier if self._disk is not None else None

    @normal_tensors
    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Move every planned parameter to host storage and install the forward hooks.

        Host copies are pinned exactly when ``plan.pin.pin`` says so. If anything fails,
        every parameter already moved is put back, so the model is exactly as it was.

        Args:
            layers: the model's layers, the same ones (and order) the plan describes.

        Returns:
            The same layers, now offloaded.

        Raises:
            ExecutionError: called twice, or a host copy failed (the cause is attached).
            PlanError: the layers do not match the plan.
        """
        require(self._state, "wrap_modules")
        layers = list(layers)
        plan = self._plan
        if self._disk is not None:
            self._disk.before_wrap()  # the files are as planned (Note [disk tier])
        claim(layers, self)
        unpacked = unpack(layers)  # quantised weights: by their inner tensors (offload.model.wrappers)
        try:
            found, from_host, views = move_all(plan, layers, self._host, self._rt, self._origin,
                                               lambda p, owner, move: self._host_of(owner), blocks=True,
                                               admission=self._disk.tier.host_admission if self._disk else None)
        except BaseException as exc:
            unpacked.pack()
            self._host.clear()
            self._origin.clear()
            if self._disk is not None:
                self._disk.close()  # the spill file goes (nothing is left on disk)
            raise_as_execution_error(exc, "moving weights to host memory failed, model left as it was",
                                     "wrap_modules")
        self._restorer = Restorer(layers, self._host, self._origin, from_host, self._rt, views, unpacked)
        self._layers = layers
        if self._disk is not None:
            self._disk.wrapped(layers, self._host)
        self._handle = ops.register(self)
        # Hooks know their layer, not their schedule position: post_init may revise the
        # plan (a layer whose offloaded parameters were all deleted leaves the schedule).
        for index in self._plan.offloaded_layers:
            self._patched[index] = patch_forward(layers[index], functools.partial(self._wrap_forward, index))
        self._hooks = [layers[index].register_state_dict_post_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
            state_dict_hook(self._host, lambda: self._plan, index))
                       for index in self._plan.offloaded_layers]
        self._hooks += unpacked.hooks(layers, range(len(layers)))  # after the host copies are put in
        mark(layers, self)
        self._state = LEAVES["wrap_modules"]
        log.info("offloaded %d parameters of %d layers to host memory (%s; moves: %s)", len(self._origin),
                 len(self._plan.offloaded_layers), "pinned" if self._plan.pin.pin else "pageable",
                 describe_moves(found))
        return layers

    @normal_tensors
    def post_init(self) -> None:
        """After the weights are final: re-sync host copies, allocate buffers, prefetch.

        Re-reads every planned parameter by name. Data that post-processing replaced (a
        new tensor, perhaps unpinned, perhaps of another shape or dtype) is copied into
        host storage pinned as the plan says; a deleted parameter is dropped. The plan is
        revised to match, then the static buffers are allocated from it, each offloaded
        parameter is pointed at its slot, and the first copies are issued.

        Raises:
            ExecutionError: not called exactly once after `wrap_modules`, or an allocation
                or copy failed.
        """
        require(self._state, "post_init")
        if self._disk is not None:
            self._disk.scan_for_writes()  # disk copies written through .data (Note [disk tier])
        try:
            revised = revise_plan(self._plan, self._resync())
        except BaseException as exc:
            raise_as_execution_error(exc, "post_init failed re-reading the weights, weights left in host memory",
                                     "post_init")
        if revised is not self._plan:
            log.info("post-processing changed offloaded parameters; plan revised")
        self._plan = plan = revised
        try:
            self._allocate_and_start(plan)
        except BaseException as exc:
            # Leave the model as wrap_modules left it (weights in host storage), so that
            # post_init can be retried or restore can run. Copies already issued may still
            # be writing the buffers: let them finish before the buffers go.
            self._rt.synchronize()
            self._drop_buffers()
            raise_as_execution_error(exc, "post_init failed, weights left in host memory", "post_init")
        self._patch_conversions()
        self._load_hooks = route_state_dict_loads((h for h, _ in self._held.values()), self._route_begin,
                                                  self._route_end)
        self._state = LEAVES["post_init"]

    def _drop_buffers(self) -> None:
        """Point every offloaded parameter at its host copy and let go of the static
        buffers and of everything in flight (call with nothing in flight)."""
        point_at_host_copies(self._plan, self._layers, self._host)
        for holder, previous in reversed(self._apply_patched):
            unpatch_forward(holder, previous, method="_apply")
        self._apply_patched = []
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []
        self._held = {}
        self._entries_of = {}
        self._reload_due = set()
        self._buffers.clear()
        if self._disk is not None:
            self._disk.stop()
        self._experts.remove()
        self._copies = []
        self._bound = []
        self._bound_names = []
        self._checks = []
        self._checks_traced = []
        self._convert_from = {}
        self._slot_params = {}
        self._copy_bytes = []
        self._pending.clear()
        self._landed.clear()

    def _allocate_and_start(self, plan: OffloadPlan) -> None:
        """Allocate the static buffers, point parameters at their slots, issue the first copies."""
        disk = self._disk
        if disk is not None:
            disk.start(plan, self._rt)  # the staging ring, its first reads staged (Note [disk tier])
        arenas = allocate_arenas(plan, self._host, self._rt, self._buffers)
        for b in plan.buffers:
            dtype = torch_dtype(b.dtype)
            slots = self._buffers.setdefault(b.key, {})
            one = self._rt.device_empty(b.shape, b.stride, dtype) if b.shared and b.slots else None
            for slot in b.slots:  # a shared key's one buffer in all of them (expert rows, Note [expert cache])
                if slot not in slots:
                    slots[slot] = one if one is not None else self._rt.device_empty(b.shape, b.stride, dtype)
        position_of = {index: i for i, index in enumerate(plan.offloaded_layers)}
        self._position_of = position_of
        # A kept position (the only owner of its slot) is loaded by the first copies and
        # stays loaded: no copy is issued for it again (`PrefetchSchedule.issued_after`).
        kept = plan.schedule.kept_positions
        self._kept = tuple(i in kept for i in range(len(plan.offloaded_layers)))
        schedule = plan.schedule
        self._successor = schedule.successor
        self._cycle_of = schedule.cycle_of
        self._cycle_ranges = schedule.cycle_ranges or ((0, 0),)
        self._cycle_first = tuple(first for first, _ in self._cycle_ranges)
        self._initial_of = tuple(tuple(i for i in schedule.initial if first <= i < stop)
                                 for first, stop in self._cycle_ranges)
        self._expected = list(self._cycle_first)
        self._next_after = plan.schedule.issued_after
        copies: list[list[tuple[torch.Tensor, torch.Tensor, Ref]]] = [[] for _ in plan.offloaded_layers]
        self._experts = experts = ExpertCaches(plan.experts, self._rt)
        slot_params: dict[int, list[nn.Parameter]] = {}
        bound: list[tuple[ParamPlan, nn.Parameter]] = []
        for p in plan.offloaded_params:
            ref = (p.layer, p.name)
            param = find_parameter(self._layers[p.layer], p.name)
            if param is None or p.slot is None:
                raise ExecutionError(f"layer {p.layer} parameter {p.name!r} vanished during post_init",
                                     name=p.name, value=p.layer)
            found = slot_params.setdefault(p.layer, [])  # each parameter of a layer once (ties included)
            if all(param is not seen for seen in found):
                found.append(param)
            bound.append((p, param))
            if not owns_buffer(p) and p.tied_to is not None:
                primary = find_parameter(self._layers[p.layer], p.tied_to[1])
                if primary is None:
                    raise ExecutionError(f"tied parameter {p.tied_to} vanished during post_init",
                                         name=p.tied_to[1], value=p.layer)
                param.data = primary.data  # shares its buffer
                continue
            buffer = self._buffers[p.buffer_key][p.slot]
            param.data = buffer
            owner = p.tied_to or ref
            if experts.take(ref, buffer):
                continue  # copied expert by expert, not by the queue (Note [expert cache])
            position = position_of[p.layer]
            # A disk position's copies read its staging buffer, not host copies (Note [disk tier]).
            source = disk.source(position, owner) if disk is not None and disk.on_disk(position) else \
                self._host_of(owner)
            copies[position].append((buffer, source, owner))
        self._bind(bound)
        self._slot_params = {layer: tuple(params) for layer, params in slot_params.items()}
        # (A staging buffer's view is part of the buffer's storage: count its slot's bytes.)
        self._copy_bytes = [sum((buffer if disk is not None and disk.on_disk(i) else source).untyped_storage().nbytes()
                                for buffer, source, _ in layer) for i, layer in enumerate(copies)]
        self._copy, self._copies = prepare_copies(self._rt, [merge_copies(layer, arenas, self._host) for layer in copies])
        experts.install(self._layers, self._host_of)
        for position in plan.schedule.initial:
            self._issue(position, self._record(), in_capture=False)

    def _resync(self) -> dict[Ref, ParamSpec | None]:
        """Re-read offloaded parameters; re-copy replaced data; report what each is now.

        Replaced data that lies in a host block (a weight post-processing moved from one
        parameter to another) is copied first: data copied into a block in place could
        otherwise overwrite it before its new parameter has its copy."""
        actual: dict[Ref, ParamSpec | None] = {}
        found: list[tuple[ParamPlan, nn.Parameter]] = []
        for p in self._plan.offloaded_params:
            ref = (p.layer, p.name)
            param = find_parameter(self._layers[p.layer], p.name)
            actual[ref] = None  # a deleted one stays None; the others are filled below, in plan order
            if param is None:
                self._dropped += 1
                self._host.drop(ref)
                log.info("layer %d parameter %r was deleted by post-processing; dropped", p.layer, p.name)
                continue
            found.append((p, param))
        # Replaced (or its tie was broken): its data gets its own host copy. The sort is stable.
        replaced = sorted((entry for entry in found if self._replaced(*entry)),
                          key=lambda entry: not self._host.in_a_block(entry[1].data))
        for p, param in replaced:
            if self._replaced(p, param):  # asked again: a tie's data is its primary's, re-copied a moment ago
                param.data = resync_data(self._plan, p, param.data, self._host, self._rt)
        for p, param in found:
            actual[(p.layer, p.name)] = current_spec(p, param.data)
        return actual

    def _replaced(self, p: ParamPlan, param: nn.Parameter) -> bool:
        """Whether `param`'s data is no longer the host copy behind it."""
        expected = self._host.get(p.tied_to or (p.layer, p.name))
        key = storage_key(param.data)
        if self._disk is not None and self._disk.written((p.layer, p.name), param):
            return True  # its copy maps its file privately: the write is not in the file (Note [disk tier])
        return expected is None or key is None or key != storage_key(expected)

    @normal_tensors
    def restore(self) -> None:
        """Put every weight back on its original device, bit for bit; remove the hooks;
        release buffers and host memory.

        A restore that stops part way leaves the model refusing to run (every layer's
        forward raises `ExecutionError` saying so) until `restore` is called again and
        finishes.

        Raises:
            ExecutionError: nothing to restore (never wrapped, or already restored), or a
                device copy failed (saying how far the restore got).
        """
        require(self._state, "restore")
        try:
            self._rt.synchronize()
        except BaseException as exc:
            raise_with_progress(exc, "restore could not wait for the device, nothing restored", "restore")
        restorer = self._restorer
        if restorer is None:
            raise ExecutionError("restore has nothing to give back (wrap_modules did not finish)",
                                 name="state", value=self._state.value)
        # The buffers go first (the device then holds no slot while weights come back to
        # it), and nothing here keeps a host copy the restorer releases (the host then
        # holds each weight once). Until restore finishes the model must not run.
        if self._state is not Lifecycle.RESTORING:
            slots = (t for slots in self._buffers.values() for t in slots.values())
            take_replacements(self._plan, self._layers, self._host, held_storages(self._host, slots), self._rt)
            # From here weights come back one by one: the model must not run until the end.
            self._guards = guard_layers(self._layers, [self._layers[index] for index in self._patched])
            self._state = Lifecycle.RESTORING
        self._drop_buffers()
        restorer.run(self._plan)
        for index, previous in self._patched.items():
            unpatch_forward(self._layers[index], previous)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        ops.unregister(self._handle)
        self._patched.clear()
        unguard_layers(self._guards)
        self._host.clear()
        if self._disk is not None:
            self._disk.close()
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
        """Where every planned parameter is now: slots after post_init, host copies before
        (see `offload.executors.live`); with a disk tier, its parameters in their files
        before post_init, and whether each file it reads is as planned; after post_init,
        each slot holding a layer compared with its host copies (`_slots_written`).

        Raises:
            ExecutionError: the model is not wrapped.
        """
        require(self._state, "check")
        slots = [t for buffers in self._buffers.values() for t in buffers.values()]
        disk = self._disk
        hosts = self._host.tensors()
        found = inspect_params(self._plan, self._layers, self._rt, ready=self._state is Lifecycle.READY,
                               slots=slots, hosts=hosts,
                               on_disk=[(p.layer, p.name) for p in disk.tier.params] if disk else (),
                               in_files=[t for t in hosts if not disk.host.writable(t)] if disk else (),
                               files=disk.files_now() if disk else ())
        if self._state is not Lifecycle.READY:
            return found
        return self._experts.checked(attrs.evolve(found, written_in_slots=self._slots_written()))
