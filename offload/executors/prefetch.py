"""`PrefetchOffloader`: weights in host memory, streamed into static device buffers a few
layers ahead of the compute that reads them.

It follows the plan and decides nothing: which parameters, pinned or not, which slot,
which copy after which layer all come from the `OffloadPlan`. Effects go through the
injected `Runtime`.

Ordering. Position ``i`` (the i-th offloaded layer) runs as: wait for its copy's done
event; run the layer; record an event on the compute stream; issue the copy the schedule
names (``next_after[i]``) on the copy stream after that event. The schedule's proof
(`check_schedule`) guarantees that copy goes into a slot whose previous owner has run, and
the event guarantees the owner's kernels are finished before the copy overwrites it.

CUDA graphs. `sync_prev_onload` before capture makes every earlier copy complete, so
inside the capture the waits for copies issued before it are skipped (their events cannot
be waited on from a capture); copies issued inside it are waited on by event, and
`join_after_forward` joins those still outstanding before the capture ends.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, final

import torch
from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.executors import ops
from offload.executors.bound import Bound, Check, compile_check, first_changed
from offload.executors.common import (
    Patched,
    Ref,
    current_spec,
    find_parameter,
    first_float_tensor,
    guard_layers,
    host_of,
    normal_tensors,
    patch_forward,
    profiling,
    raise_as_execution_error,
    raise_with_progress,
    refuse_autograd,
    torch_dtype,
    unguard_layers,
    unpatch_forward,
)
from offload.executors.conversions import converting_apply, same_memory
from offload.executors.hoststore import HostSource, HostStore
from offload.executors.lifecycle import LEAVES, Lifecycle, refuse, require
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
from offload.protocols import Event, PreparedCopies, Runtime
from offload.pure.check import LiveCheck
from offload.pure.plan.blocks import Span, merge_spans, slot_arenas
from offload.pure.plan.layout import owns_buffer
from offload.pure.plan.plan import Backend, OffloadPlan, ParamPlan
from offload.pure.plan.revise import revise_plan
from offload.pure.spec.values import ParamSpec
from offload.pure.stats import OffloadStats
from offload.runtime.arena import CAN_CARVE, carve

__all__ = ["PrefetchOffloader"]

log = logging.getLogger(__name__)

Chunks = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # one copy: its (destination, source) memcpys


@final
class PrefetchOffloader:
    """The prefetch backend. Create it with `offload.create_offloader`.

    Args:
        plan: a plan whose backend is prefetch.
        runtime: the effects to use (`CudaRuntime`, `CpuRuntime`, or a fake).
        host_source: where host copies come from before the runtime is asked
            (`HostSource`, e.g. a segment shared by the processes of one host,
            `offload.sharing`); None: the runtime makes them all.

    Raises:
        PlanError: the plan's backend is not prefetch.
    """

    def __init__(self, plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None) -> None:
        if plan.backend is not Backend.PREFETCH:
            raise PlanError(f"PrefetchOffloader runs prefetch plans, got backend {plan.backend.value}",
                            name="backend", value=plan.backend.value)
        self._plan = plan
        self._rt = runtime
        self._state = Lifecycle.NEW
        self._layers: list[nn.Module] = []
        self._host = HostStore(runtime, pin=plan.pin.method, source=host_source)  # owner (layer, name) -> host copy
        self._origin: dict[Ref, torch.device] = {}  # every offloaded (layer, name) -> where restore puts it
        self._restorer: Restorer | None = None
        self._hooks: list[Any] = []  # state_dict hook handles
        self._patched: dict[int, Callable[..., Any] | None] = {}  # layer index -> previous forward attr
        self._guards: Patched = []  # the other layers' refusing forwards while a restore is unfinished
        # position -> its copies, each as the runtime cuts it (`PreparedCopies`, worked out
        # at post_init) or as one (buffer, host) pair for `copy_after`; `_copy` issues one.
        self._copies: list[list[Chunks]] = []
        self._copy: Callable[[Chunks, Event | None], Event] = self._copy_after
        # position -> its offloaded parameters as post_init left them, checked before each
        # run (`_wait_at`), and their names within the layer, for messages.
        self._bound: list[list[Bound]] = []
        self._bound_names: list[list[str]] = []
        self._checks: list[Check] = []  # position -> its check (`offload.executors.bound`), versions included
        self._checks_traced: list[Check] = []  # the same without versions, for the custom ops' path
        # id of an offloaded Parameter -> (it, the owner of its host copy): what a
        # conversion (`model.to()`, `_apply`) converts instead of its slot (post_init).
        self._convert_from: dict[int, tuple[nn.Parameter, Ref]] = {}
        # id of a module holding offloaded parameters -> (it, its entries: (key in its
        # _parameters, the Parameter, owner of its host copy, its slot data)), for
        # load_state_dict routing; id of a bound Parameter -> where it is in _bound
        # (position, index), once per name it has (post_init).
        self._held: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, Ref, torch.Tensor]]]] = {}
        self._entries_of: dict[int, list[tuple[int, int]]] = {}
        self._load_hooks: list[Any] = []  # load_state_dict hook handles (post_init)
        self._reload_due = False  # host copies were written by load_state_dict: slots to refill
        self._apply_patched: list[tuple[nn.Module, Callable[..., Any] | None]] = []  # holder -> previous _apply
        self._copy_bytes: list[int] = []  # position -> bytes its copies move (post_init)
        self._slot_params: dict[int, tuple[nn.Parameter, ...]] = {}  # layer -> its slot parameters (post_init)
        self._buffers: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], dict[int, torch.Tensor]] = {}
        # Per position, the copy in flight for its next run: its done event and whether it
        # was issued inside a CUDA graph capture. A position in `_landed` has its weights
        # in its slot with nothing to wait for (see join_after_forward).
        self._pending: dict[int, tuple[Event, bool]] = {}
        self._landed: set[int] = set()
        self._position_of: dict[int, int] = {}  # offloaded layer -> schedule position (post_init)
        self._next_after: tuple[int | None, ...] = ()  # the schedule's next_after, kept positions left out (post_init)
        self._kept: tuple[bool, ...] = ()  # position -> whether it is kept (the only owner of its slot; post_init)
        self._successor: tuple[int, ...] = ()  # position -> the position expected after it (post_init)
        self._dropped = 0
        # The schedule position expected next, and whether layers get their copy when
        # they run until the next step begins (see `_realign`).
        self._expected = 0
        self._recovering = False
        self._realignments = 0
        self._copies_issued = 0
        self._bytes_copied = 0
        self._timed_bytes = 0  # of copies issued outside a CUDA graph capture (the runtime times those)
        self._steps = 0
        self._step_log = StepLog()
        self._handle = 0

    @property
    def plan(self) -> OffloadPlan:
        """The plan being run; after `post_init`, revised for parameters that post-processing
        replaced or deleted."""
        return self._plan

    # ---- setup ----------------------------------------------------------------------

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
        claim(layers, self)
        try:
            found, from_host, views = move_all(plan, layers, self._host, self._rt, self._origin,
                                               lambda p, owner, move: self._host_of(owner), blocks=True)
        except BaseException as exc:
            self._host.clear()
            self._origin.clear()
            raise_as_execution_error(exc, "moving weights to host memory failed, model left as it was",
                                     "wrap_modules")
        self._restorer = Restorer(layers, self._host, self._origin, from_host, self._rt, views)
        self._layers = layers
        self._handle = ops.register(self)
        # Hooks know their layer, not their schedule position: post_init may revise the
        # plan (a layer whose offloaded parameters were all deleted leaves the schedule).
        for index in self._plan.offloaded_layers:
            self._patched[index] = patch_forward(layers[index], functools.partial(self._wrap_forward, index))
        self._hooks = [layers[index].register_state_dict_post_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
            state_dict_hook(self._host, lambda: self._plan, index))
                       for index in self._plan.offloaded_layers]
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
        self._reload_due = False
        self._buffers.clear()
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

    def _allocate_arenas(self, plan: OffloadPlan) -> dict[int, tuple[torch.Tensor, int]]:
        """Where the host store made blocks (`offload.pure.plan.blocks`): each slot's aligned
        buffers back to back in one device allocation (an arena), each over a storage of
        its own (`offload.runtime.arena.carve`: views of one tensor would alias under
        torch.compile). Returns, by data pointer of each such buffer, (its arena's flat
        view, its byte offset)."""
        placed: dict[int, tuple[torch.Tensor, int]] = {}
        if not self._host.has_blocks or not CAN_CARVE:
            return placed
        by_key = {b.key: b for b in plan.buffers}
        for arena in slot_arenas(plan.buffers):
            flat = self._rt.device_empty((arena.nbytes,), (1,), torch.uint8)
            for key, offset in zip(arena.keys, arena.offsets, strict=True):
                b = by_key[key]
                buffer = carve(flat, offset, b.shape, b.stride, torch_dtype(b.dtype))
                self._buffers.setdefault(key, {})[arena.slot] = buffer
                placed[buffer.data_ptr()] = (flat, offset)
        return placed

    def _merged(self, copies: list[tuple[torch.Tensor, torch.Tensor, Ref]],
                arenas: dict[int, tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A position's copies, those that are contiguous in both an arena and a host block
        merged into one (`merge_spans`)."""
        spans = []
        for buffer, host, owner in copies:
            dst = arenas.get(buffer.data_ptr())
            src = self._host.block_of(owner)
            nbytes = host.untyped_storage().nbytes()
            if dst is None or src is None:
                spans.append(Span(dst=None, dst_offset=0, src=None, src_offset=0, nbytes=nbytes))
            else:
                spans.append(Span(dst=dst[0], dst_offset=dst[1], src=src[0], src_offset=src[1], nbytes=nbytes))
        merged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in merge_spans(spans):
            if len(group) == 1:
                merged.append(copies[group[0]][:2])
                continue
            first, last = spans[group[0]], spans[group[-1]]
            dst_flat, src_flat = arenas[copies[group[0]][0].data_ptr()][0], first.src
            size = last.dst_offset + last.nbytes - first.dst_offset
            if not isinstance(src_flat, torch.Tensor):
                raise ExecutionError("a host block has no flat view", name="block", value=group)
            merged.append((dst_flat[first.dst_offset:first.dst_offset + size],
                           src_flat[first.src_offset:first.src_offset + size]))
        return merged

    def _prepared(self, copies: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[list[Chunks]]:
        """Each position's copies as `_issue` hands them to `_copy` (set here): cut once by
        a runtime with `PreparedCopies`, else each its (buffer, host) pair for `copy_after`."""
        rt = self._rt
        if isinstance(rt, PreparedCopies):
            self._copy = rt.copy_chunks_after
            return [[rt.copy_chunks(buffer, host) for buffer, host in layer] for layer in copies]
        self._copy = self._copy_after
        return [[((buffer, host),) for buffer, host in layer] for layer in copies]

    def _copy_after(self, chunks: Chunks, after: Event | None) -> Event:
        """`Runtime.copy_after` of the one (buffer, host) pair in `chunks` (a runtime
        without `PreparedCopies`)."""
        ((buffer, host),) = chunks
        return self._rt.copy_after(buffer, host, after)

    def _allocate_and_start(self, plan: OffloadPlan) -> None:
        """Allocate the static buffers, point parameters at their slots, issue the first copies."""
        arenas = self._allocate_arenas(plan)
        for b in plan.buffers:
            dtype = torch_dtype(b.dtype)
            slots = self._buffers.setdefault(b.key, {})
            for slot in b.slots:
                if slot not in slots:
                    slots[slot] = self._rt.device_empty(b.shape, b.stride, dtype)
        position_of = {index: i for i, index in enumerate(plan.offloaded_layers)}
        self._position_of = position_of
        # A kept position (the only owner of its slot) is loaded by the first copies and
        # stays loaded: no copy is issued for it again (`PrefetchSchedule.issued_after`).
        kept = plan.schedule.kept_positions
        self._kept = tuple(i in kept for i in range(len(plan.offloaded_layers)))
        self._successor = tuple((i + 1) % len(plan.offloaded_layers) for i in range(len(plan.offloaded_layers)))
        self._next_after = plan.schedule.issued_after
        copies: list[list[tuple[torch.Tensor, torch.Tensor, Ref]]] = [[] for _ in plan.offloaded_layers]
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
            copies[position_of[p.layer]].append((buffer, self._host_of(owner), owner))
        self._bind(bound)
        self._slot_params = {layer: tuple(params) for layer, params in slot_params.items()}
        self._copy_bytes = [sum(host.untyped_storage().nbytes() for _, host, _ in layer) for layer in copies]
        self._copies = self._prepared([self._merged(layer, arenas) for layer in copies])
        for position in plan.schedule.initial:
            self._issue(position, self._record(), in_capture=False)

    def _bind(self, bound: Sequence[tuple[ParamPlan, nn.Parameter]]) -> None:
        """Fix what `_wait_at` checks before each run of a position: where each of its
        offloaded parameters is held, the Parameter, its data pointer and version counter;
        what a conversion of each converts (`_converted`), and what `load_state_dict`
        routing needs (`_route_begin`)."""
        self._bound = [[] for _ in self._plan.offloaded_layers]
        self._bound_names = [[] for _ in self._plan.offloaded_layers]
        self._convert_from = {}
        self._held = {}
        self._entries_of = {}
        for p, param in bound:
            prefix, _, leaf = p.name.rpartition(".")
            holder = self._layers[p.layer].get_submodule(prefix) if prefix else self._layers[p.layer]
            position = self._position_of[p.layer]
            owner = p.tied_to or (p.layer, p.name)
            self._held.setdefault(id(holder), (holder, []))[1].append((leaf, param, owner, param.data))
            self._entries_of.setdefault(id(param), []).append((position, len(self._bound[position])))
            self._bound[position].append((holder._parameters, leaf, param, param.data_ptr(), param._version))
            self._bound_names[position].append(p.name)
            self._convert_from[id(param)] = (param, owner)
        self._compile_checks()

    def _compile_checks(self, positions: Sequence[int] | None = None) -> None:
        """(Re)generate the checks of `positions` (None: all) from `_bound`."""
        if positions is None:
            self._checks = [compile_check(entries, versions=True) for entries in self._bound]
            self._checks_traced = [compile_check(entries, versions=False) for entries in self._bound]
            return
        for position in positions:
            self._checks[position] = compile_check(self._bound[position], versions=True)
            self._checks_traced[position] = compile_check(self._bound[position], versions=False)

    def _patch_conversions(self) -> None:
        """Make conversions of the offloaded parameters convert their host copies.

        ``model.to(dtype)``, ``.half()``, ``.cuda()`` and the like go through
        ``nn.Module._apply(fn)``, which calls ``fn`` on every parameter of every module.
        On a prefetched parameter that would convert its slot, which holds whichever layer
        last ran there (another layer's weights, for a slot several layers share), and
        `restore` would keep that. Each module holding an offloaded parameter gets an
        instance ``_apply`` that hands ``fn`` the parameter's host copy instead, wherever
        the call starts (the model, the stack, a layer or a part of it). A conversion that
        changes nothing (``.cuda()`` of a model on the device) leaves the slot in place.
        """
        for holder, _ in self._held.values():
            self._apply_patched.append((holder, patch_forward(holder, self._wrap_apply, method="_apply")))

    def _wrap_apply(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return converting_apply(original, self._converted)

    def _converted(self, param: nn.Parameter, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn`` (a conversion of ``nn.Module._apply``) of `param`, applied to its host
        copy when `param` is an offloaded parameter pointing at its slot and ``fn`` would
        change it (see `_patch_conversions`); else to `param` itself."""
        entry = self._convert_from.get(id(param))
        out = fn(param)
        if entry is None or entry[0] is not param or self._state is not Lifecycle.READY or same_memory(out, param):
            return out
        host = self._host_of(entry[1])
        converted = fn(host)
        # A conversion that leaves the host copy as it is (``.cpu()``) gives the
        # parameter a tensor of its own: the host copy stays the offloader's.
        return converted.clone() if same_memory(converted, host) else converted

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
        return expected is None or key is None or key != storage_key(expected)

    # ---- the forward path -----------------------------------------------------------

    def _wrap_forward(self, layer: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        names = tuple(p.name for p in self._plan.offloaded_params if p.layer == layer)
        compiled = self._compiled_forward(layer, forward, names)
        is_compiling = torch.compiler.is_compiling

        def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
            # Eager: the executor is called directly (the custom ops, their dispatch and
            # aliasing checks, are for torch.compile, which must see the ordering).
            if is_compiling():
                return compiled(*args, **kwargs)
            if torch.is_grad_enabled():
                refuse_autograd(layer, self._layers[layer], names, args, kwargs)
            # wait_layer and start_after_layer, with the position looked up once for both.
            # The capture state is asked each time: a manual capture may begin or end
            # inside the layer, and the copy issued after it must be tagged as it is.
            position = self._position(layer)
            if position is None:
                return forward(*args, **kwargs)
            if profiling():
                with torch.profiler.record_function(f"offload.wait layer {layer}"):
                    self._wait_at(position, self._rt.is_capturing())
                out = forward(*args, **kwargs)
                with torch.profiler.record_function(f"offload.copy after layer {layer}"):
                    if not self._recovering:
                        self._start_at(position, self._rt.is_capturing())
                return out
            self._wait_at(position, self._rt.is_capturing())
            out = forward(*args, **kwargs)
            if not self._recovering:
                self._start_at(position, self._rt.is_capturing())
            return out

        return offloaded_forward

    def _compiled_forward(self, layer: int, forward: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
        """The forward torch.compile traces: the wait and the start as custom ops that
        declare the layer's slot tensors mutated (see `ops`)."""
        handle = self._handle
        if ops.bound_slots(handle) is None:
            # The slot tensors of each layer, as the ops are handed them: its offloaded
            # parameters (whose data are slot buffers), each once, as post_init found them.
            # Holds the offloader weakly (the ops' registry outlives no model).
            owner = weakref.ref(self)

            def slot_tensors(index: int) -> Sequence[torch.Tensor]:
                offloader = owner()
                return () if offloader is None else offloader._slot_params.get(index, ())

            ops.bind_slots(handle, slot_tensors)

        def compiled_forward(*args: Any, **kwargs: Any) -> Any:
            refuse_autograd(layer, self._layers[layer], names, args, kwargs)
            activation = first_float_tensor((*args, *kwargs.values()))
            if activation is None:
                self.wait_layer(layer)
            else:
                ops.wait_prefetch(activation, list(self._slot_params.get(layer, ())), handle, layer)
            out = forward(*args, **kwargs)
            produced = first_float_tensor((out,))
            if produced is None:
                produced = activation
            if produced is None:
                self.start_after_layer(layer)
            else:
                # The layer whose copy the start issues: its slot is the one overwritten.
                position = self._position_of.get(layer)
                after = None if position is None else self._next_after[position]
                target = ops.NO_LAYER if after is None else self._plan.offloaded_layers[after]
                overwritten = [] if target == ops.NO_LAYER else list(self._slot_params.get(target, ()))
                ops.start_prefetch(produced, overwritten, handle, layer, target)
            return out

        return compiled_forward

    def _issue(self, position: int, after: Event, *, in_capture: bool) -> None:
        done: Event = after
        first = True
        copy = self._copy
        try:
            for chunks in self._copies[position]:
                done = copy(chunks, after if first else None)
                first = False
                self._copies_issued += 1
        except BaseException as exc:
            # No entry for the position: the layer that needs it realigns (copies it again).
            raise_as_execution_error(
                exc, f"copying offloaded layer {self._plan.offloaded_layers[position]}'s weights failed", "forward")
        self._bytes_copied += self._copy_bytes[position]
        if not in_capture:
            self._timed_bytes += self._copy_bytes[position]
        self._pending[position] = (done, in_capture)
        self._landed.discard(position)

    def _check_capturable(self) -> None:
        if self._plan.pin.pin and self._host.fallbacks:
            raise ExecutionError(
                f"cannot capture a CUDA graph: pinning failed for {self._host.fallbacks} host copies, "
                "which stayed in pageable memory (see stats().pin_fallbacks), and PyTorch refuses "
                "host-to-device copies from pageable memory during capture",
                name="pin_fallbacks",
                value=self._host.fallbacks,
            )
        if not self._plan.pin.pin:
            raise ExecutionError(
                "cannot capture a CUDA graph of a model whose offloaded weights are in pageable "
                f"host memory (pinning is off: {self._plan.pin.explanation}); PyTorch refuses "
                "host-to-device copies from pageable memory during capture. Run without CUDA "
                "graphs, or plan with pinning enabled",
                name="pin",
                value=False,
            )

    def _position(self, layer: int) -> int | None:
        if self._state is not Lifecycle.READY:
            refuse(self._state, "forward", "an offloaded layer ran before post_init()",
                   subject=f"offloaded layer {layer}")
        return self._position_of.get(layer)

    def wait_layer(self, layer: int) -> None:
        """Before `layer` runs: make the compute stream wait for its weights' copy (called
        by the custom op). Nothing to do for a layer the revised plan no longer offloads."""
        position = self._position(layer)
        if position is not None:
            self._wait_at(position, self._rt.is_capturing(), eager=False)

    def _wait_at(self, position: int, capturing: bool, eager: bool = True) -> None:
        """`wait_layer` of the layer at schedule `position`, `capturing` as the runtime
        says; `eager`: the layer is called directly, not through the custom ops."""
        if position == 0:
            if self._step_log.active and self._steps:
                self._step_log.step(self._steps, self.stats)  # the steps finished so far, their copies counted
            self._steps += 1
        if capturing:
            self._check_capturable()
        # Each offloaded parameter is still the one its module holds, still points at its
        # slot, and was not written in place (its version counter; not under the ops,
        # whose declared mutations of the slot tensors move it: see `offload.executors.ops`).
        if not (self._checks[position] if eager else self._checks_traced[position])():
            self._refuse_changed(position, eager)
        expected = self._expected
        self._expected = self._successor[position]
        if position != expected or self._recovering:
            self._realign(position, expected, capturing)
        entry = self._pending.pop(position, None)
        if entry is None:
            if position in self._landed:  # its copy was joined at the end of a capture
                self._landed.discard(position)
                return
            self._realign(position, expected, capturing)  # no copy in flight for it
            entry = self._pending.pop(position)
        if self._kept[position]:
            # A kept position (the only owner of its slot) keeps its one copy's event: every
            # step waits on it again (free once done), on whatever stream runs the layer then.
            self._pending[position] = entry
        done, in_capture = entry
        if capturing == in_capture:
            try:
                self._rt.wait(done)
            except BaseException as exc:
                raise_as_execution_error(
                    exc, f"waiting for offloaded layer {self._plan.offloaded_layers[position]}'s weights failed",
                    "forward")
        # Otherwise the event belongs to the other side of a capture boundary and cannot be
        # waited on: issued before the capture, sync_prev_onload made sure it landed.

    def _record(self) -> Event:
        try:
            return self._rt.record()
        except BaseException as exc:
            raise_as_execution_error(exc, "recording an event on the compute stream failed", "forward")

    def _refuse_changed(self, position: int, eager: bool) -> NoReturn:
        """Raise for the first bound parameter of `position` that changed after post_init."""
        layer = self._plan.offloaded_layers[position]
        index = max(first_changed(self._bound[position], versions=eager), 0)
        params, leaf, param, pointer, _ = self._bound[position][index]
        name = self._bound_names[position][index]
        now = params.get(leaf)
        if now is not param:
            raise ExecutionError(
                f"layer {layer} parameter {name!r} was {'deleted' if now is None else 'replaced by a new Parameter'} "
                "after post_init, and the layer would run without the weights the copies bring. Call restore() "
                "first (it keeps the new Parameter's data), make the change, then offload again",
                name=name, value=layer)
        if param.data_ptr() != pointer:
            raise ExecutionError(
                f"layer {layer} parameter {name!r} no longer points at its static buffer: it was changed after "
                f"post_init (now {param.dtype}, {tuple(param.shape)}; e.g. by model.to(), or a tensor assigned to "
                "it), and the copies would fill a buffer it does not read. Call restore() first (it keeps the new "
                "data), make the change, then offload again",
                name=name, value=layer)
        raise ExecutionError(
            f"layer {layer} parameter {name!r} was written in place after post_init (e.g. by load_state_dict, or "
            "param.copy_() under no_grad): the new values went into a static buffer that other layers share, not "
            "into its host copy, and the next copy would overwrite them. Give an offloaded model new weights with "
            "offloader.load_weights(...); restore() gives back the weights as they were before the write",
            name=name, value=layer)

    def _realign(self, position: int, expected: int, capturing: bool) -> None:
        """`position` runs when the schedule expected `expected` (a forward stopped part
        way, layers were skipped or run out of order or twice), or while realigning: put
        the schedule right so that the weights are correct, whatever the order.

        At the first position a new step begins: everything in flight is finished and the
        step's first copies are issued as `post_init` does, and prefetching goes on. At any
        other position the layer gets its own copy now (the compute stream waits for it),
        and so does every later one until the next step begins; nothing is prefetched
        meanwhile. Each realignment is counted (`stats().realignments`) and logged;
        refilling the slots after ``load_state_dict`` is not a realignment.

        Raises:
            ExecutionError: inside a CUDA graph capture (the order must be the eager one).
        """
        layers = self._plan.offloaded_layers
        # After load_state_dict wrote host copies (`_route_end`) every slot is refilled
        # the same way: that is not counted as a realignment.
        reloaded, self._reload_due = self._reload_due, False
        if capturing:
            raise ExecutionError(
                f"offloaded layer {layers[position]} ran out of order inside a CUDA graph capture (layer "
                f"{layers[expected if expected >= 0 else 0]} was next, or weights were loaded and sync_prev_onload "
                "was not called before the capture): capture a forward that runs every offloaded layer once, in order",
                name="position", value=position,
            )
        if reloaded:
            log.debug("offloaded layer %d: slots refilled after load_state_dict", layers[position])
        elif not self._recovering:
            self._realignments += 1
            log.info("offloaded layer %d ran %s: schedule realigned (%s)", layers[position],
                     "without a copy in flight" if position == expected else f"when layer {layers[expected]} was next",
                     "new step" if position == 0 else "copies on demand until the next step")
        self._rt.synchronize()
        if position == 0:
            self._restart()
            if 0 not in self._pending:  # not a prefetched position at step start: copy it now
                self._issue(0, self._record(), in_capture=False)
            return
        self._pending.clear()
        self._landed.clear()
        self._recovering = True
        self._issue(position, self._record(), in_capture=False)

    def start_after_layer(self, layer: int) -> None:
        """After `layer` ran: issue the copy the schedule names next (called by the op);
        nothing while the schedule is being realigned."""
        position = self._position(layer)
        if position is not None and not self._recovering:
            self._start_at(position, self._rt.is_capturing())

    def _start_at(self, position: int, capturing: bool) -> None:
        """`start_after_layer` of the layer at schedule `position` (not while realigning)."""
        target = self._next_after[position]
        if target is None:
            return
        if capturing:
            self._check_capturable()
        self._issue(target, self._record(), in_capture=capturing)

    # ---- new weights ----------------------------------------------------------------

    @normal_tensors
    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """Give the model new weights without restoring it (`offload.executors.reload`):
        offloaded ones into their host copies, resident ones and buffers in place; then,
        after `post_init`, a step's first copies are issued again from the new host
        copies, so the next forward (eager, compiled or a CUDA graph replay after
        `sync_prev_onload`) computes with the new weights.

        ``model.load_state_dict`` is routed the same way (`_route_begin`). Writes made
        around both (``param.copy_()`` into a parameter that points at a shared slot) are
        refused at the next forward; a call of this clears that refusal (the host copies
        hold what the model computes with again).

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
        try:
            loaded = write_weights(weights, self._plan, self._layers, self._host, prefix=prefix,
                                   skip_read_only=skip_read_only)
        except BaseException:
            self._reloaded()  # what was written is what the model computes with
            raise
        self._reloaded()
        log_loaded(loaded)

    def _route_begin(self, holder: nn.Module) -> None:
        """``load_state_dict`` reaches `holder`: point its offloaded parameters at their
        host copies, so that torch writes the new values there (see `route_state_dict_loads`)."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return  # before post_init the parameters point at their host copies already
        live = [(param, owner) for leaf, param, owner, *_ in entry[1] if holder._parameters.get(leaf) is param]
        refuse_read_only(self._host, (owner for _, owner in live), "load_state_dict")
        self._rt.synchronize()  # copies in flight read the host copies about to be written
        for param, owner in live:
            param.data = self._host_of(owner)

    def _route_end(self, holder: nn.Module) -> None:
        """`holder`'s part of ``load_state_dict`` is done: its parameters point at their
        slots again, their writes are accepted, and the slots are refilled before the
        next forward or replay (`_reload_due`)."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return
        changed: set[int] = set()
        for leaf, param, owner, slot in entry[1]:
            if holder._parameters.get(leaf) is param and same_memory(param.data, self._host_of(owner)):
                param.data = slot
                for position, index in self._entries_of[id(param)]:  # every name it has (a tie)
                    params, name, _, pointer, _ = self._bound[position][index]
                    self._bound[position][index] = (params, name, param, pointer, param._version)
                    changed.add(position)
        self._compile_checks(sorted(changed))
        self._reload_due = True
        self._expected = -1  # no position: the next one realigns, which refills the slots

    def _reloaded(self) -> None:
        """After host copies were written: accept the parameters' version counters as
        they are, and fill the slots afresh (after post_init)."""
        if self._state is not Lifecycle.READY:
            return
        self._bound = [[(params, leaf, param, pointer, param._version) for params, leaf, param, pointer, _ in entries]
                       for entries in self._bound]
        self._compile_checks()
        self._refill()

    def _refill(self) -> None:
        """The host copies changed: the next forward is a new step, whose first copies
        are issued now (call with nothing in flight)."""
        self._expected = 0
        self._reload_due = False
        self._restart()

    def _restart(self) -> None:
        """Begin a step afresh, as post_init does: nothing pending or landed, the step's
        first copies issued (call with nothing in flight)."""
        self._pending.clear()
        self._landed.clear()
        self._recovering = False
        for first in self._plan.schedule.initial:
            self._issue(first, self._record(), in_capture=False)

    # ---- CUDA graphs ----------------------------------------------------------------

    def sync_prev_onload(self) -> None:
        """Before capture or replay: block until every copy issued so far is done; where
        the last step did not end cleanly (a forward stopped part way or realigned, or
        ``load_state_dict`` wrote host copies), the step's first copies are issued afresh
        first, so the slots a replay begins with hold their own layers' weights.

        Raises:
            ExecutionError: called before `post_init`.
        """
        require(self._state, "sync_prev_onload")
        # A capture or replay begins a step with the slots of its first positions filled
        # (a replay refills them before it ends). Refill them unless a whole step ended
        # here: a forward that stopped part way or realigned, or load_state_dict, left
        # other weights there.
        if self._reload_due or self._recovering or self._expected != 0:
            self._rt.synchronize()
            self._refill()
        self._rt.synchronize()

    def wait_for_copies(self) -> None:
        """Block until every copy issued so far is done (`ops.PrefetchTarget`: the start
        op of a compile path that hands it copies of the slots, mid-forward)."""
        self._rt.synchronize()

    def join_after_forward(self) -> None:
        """Inside a capture, after the forward: join every copy issued in it and not yet
        waited on, so the capture ends with no unjoined stream.

        Those positions then count as landed: a capture executes nothing, so after it the
        slots hold what they held before it (the next step's first positions, synced by
        `sync_prev_onload`), and each replay refills them before it ends. Outside a
        capture nothing of that kind is outstanding and it returns at once.
        """
        for position in sorted(p for p, (_, in_capture) in self._pending.items() if in_capture):
            done, _ = self._pending.pop(position)
            self._rt.wait(done)
            self._landed.add(position)

    # ---- teardown and counters ------------------------------------------------------

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
        """Counters since `wrap_modules` (see `OffloadStats`)."""
        active = self._state in (Lifecycle.WRAPPED, Lifecycle.READY)
        return OffloadStats(
            params_offloaded=len(self._plan.offloaded_params) if active else 0,
            params_dropped=self._dropped,
            host_bytes=self._host.nbytes,
            device_buffer_bytes=sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                     for slots in self._buffers.values() for t in slots.values()}.values()),
            copies_issued=self._copies_issued,
            bytes_copied=self._bytes_copied,
            wait_seconds=self._rt.waited_seconds(),
            pin_fallbacks=self._host.fallbacks,
            realignments=self._realignments,
            steps=self._steps,
            copy_seconds=self._rt.copy_seconds(),
            timed_bytes=self._timed_bytes,
        )

    def check(self) -> LiveCheck:
        """Where every planned parameter is now: slots after post_init, host copies before
        (see `offload.executors.live`).

        Raises:
            ExecutionError: the model is not wrapped.
        """
        require(self._state, "check")
        slots = [t for buffers in self._buffers.values() for t in buffers.values()]
        return inspect_params(self._plan, self._layers, self._rt, ready=self._state is Lifecycle.READY,
                              slots=slots, hosts=self._host.tensors())

    def log_stats_every(self, steps: int | None = None, seconds: float | None = None) -> None:
        """Log one line of `stats()` (logger ``offload.pure.stats``, INFO) every `steps` forward
        steps and/or every `seconds` seconds (checked at each step); no arguments: stop.

        Raises:
            ExecutionError: `steps` or `seconds` is not a positive number.
        """
        self._step_log.configure(steps, seconds)

    def _host_of(self, ref: Ref) -> torch.Tensor:
        return host_of(self._host, ref)

