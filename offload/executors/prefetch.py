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
from typing import Any, final

import torch
from torch import nn

from offload.describe import storage_key
from offload.errors import ExecutionError, PlanError
from offload.executors import ops
from offload.executors.common import (
    Lifecycle,
    Ref,
    current_spec,
    find_parameter,
    first_float_tensor,
    host_of,
    normal_tensors,
    patch_forward,
    profiling,
    raise_as_execution_error,
    refuse_autograd,
    torch_dtype,
    unpatch_forward,
)
from offload.executors.hoststore import HostSource, HostStore
from offload.executors.live import LiveCheck, inspect_params
from offload.executors.moving import (
    Restorer,
    claim,
    describe_moves,
    held_storages,
    mark,
    move_all,
    point_at_host_copies,
    resync_data,
    state_dict_hook,
    take_replacements,
    unmark,
)
from offload.executors.telemetry import StepLog
from offload.protocols import Event, PreparedCopies, Runtime
from offload.pure.blocks import Span, merge_spans, slot_arenas
from offload.pure.layout import owns_buffer
from offload.pure.plan import Backend, OffloadPlan, ParamPlan
from offload.pure.revise import revise_plan
from offload.pure.spec import ParamSpec
from offload.runtime.arena import CAN_CARVE, carve
from offload.stats import OffloadStats

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
        # position -> its copies, each as the runtime cuts it (`PreparedCopies`, worked out
        # at post_init) or as one (buffer, host) pair for `copy_after`; `_copy` issues one.
        self._copies: list[list[Chunks]] = []
        self._copy: Callable[[Chunks, Event | None], Event] = self._copy_after
        # position -> (parameter, its buffer's data pointer and dtype), checked before each run
        self._bound: list[list[tuple[nn.Parameter, int, torch.dtype]]] = []
        self._copy_bytes: list[int] = []  # position -> bytes its copies move (post_init)
        self._slot_params: dict[int, tuple[nn.Parameter, ...]] = {}  # layer -> its slot parameters (post_init)
        self._buffers: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], dict[int, torch.Tensor]] = {}
        # Per position, the copy in flight for its next run: its done event and whether it
        # was issued inside a CUDA graph capture. A position in `_landed` has its weights
        # in its slot with nothing to wait for (see join_after_forward).
        self._pending: dict[int, tuple[Event, bool]] = {}
        self._landed: set[int] = set()
        self._position_of: dict[int, int] = {}  # offloaded layer -> schedule position (post_init)
        self._next_after: tuple[int | None, ...] = ()  # the schedule's next_after (post_init)
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
        if self._state is not Lifecycle.NEW:
            raise ExecutionError(f"wrap_modules was already called (state {self._state.value})",
                                 name="state", value=self._state.value)
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
        self._state = Lifecycle.WRAPPED
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
        if self._state is not Lifecycle.WRAPPED:
            raise ExecutionError(f"post_init needs wrap_modules first and runs once (state {self._state.value})",
                                 name="state", value=self._state.value)
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
        self._state = Lifecycle.READY

    def _drop_buffers(self) -> None:
        """Point every offloaded parameter at its host copy and let go of the static
        buffers and of everything in flight (call with nothing in flight)."""
        point_at_host_copies(self._plan, self._layers, self._host)
        self._buffers.clear()
        self._copies = []
        self._bound = []
        self._slot_params = {}
        self._copy_bytes = []
        self._pending.clear()
        self._landed.clear()

    def _allocate_arenas(self, plan: OffloadPlan) -> dict[int, tuple[torch.Tensor, int]]:
        """Where the host store made blocks (`offload.pure.blocks`): each slot's aligned
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
        self._next_after = tuple(plan.schedule.next_after)
        copies: list[list[tuple[torch.Tensor, torch.Tensor, Ref]]] = [[] for _ in plan.offloaded_layers]
        self._bound = [[] for _ in plan.offloaded_layers]
        slot_params: dict[int, list[nn.Parameter]] = {}
        for p in plan.offloaded_params:
            ref = (p.layer, p.name)
            param = find_parameter(self._layers[p.layer], p.name)
            if param is None or p.slot is None:
                raise ExecutionError(f"layer {p.layer} parameter {p.name!r} vanished during post_init",
                                     name=p.name, value=p.layer)
            found = slot_params.setdefault(p.layer, [])  # each parameter of a layer once (ties included)
            if all(param is not seen for seen in found):
                found.append(param)
            if not owns_buffer(p) and p.tied_to is not None:
                primary = find_parameter(self._layers[p.layer], p.tied_to[1])
                if primary is None:
                    raise ExecutionError(f"tied parameter {p.tied_to} vanished during post_init",
                                         name=p.tied_to[1], value=p.layer)
                param.data = primary.data  # shares its buffer
                continue
            buffer = self._buffers[p.buffer_key][p.slot]
            param.data = buffer
            self._bound[position_of[p.layer]].append((param, buffer.data_ptr(), buffer.dtype))
            owner = p.tied_to or ref
            copies[position_of[p.layer]].append((buffer, self._host_of(owner), owner))
        self._slot_params = {layer: tuple(params) for layer, params in slot_params.items()}
        self._copy_bytes = [sum(host.untyped_storage().nbytes() for _, host, _ in layer) for layer in copies]
        self._copies = self._prepared([self._merged(layer, arenas) for layer in copies])
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
            if profiling():
                with torch.profiler.record_function(f"offload.wait layer {layer}"):
                    self.wait_layer(layer)
                out = forward(*args, **kwargs)
                with torch.profiler.record_function(f"offload.copy after layer {layer}"):
                    self.start_after_layer(layer)
                return out
            # wait_layer and start_after_layer, with the position looked up once for both.
            # The capture state is asked each time: a manual capture may begin or end
            # inside the layer, and the copy issued after it must be tagged as it is.
            position = self._position(layer)
            if position is None:
                return forward(*args, **kwargs)
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
                after = None if position is None else self._plan.schedule.next_after[position]
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
            raise ExecutionError(
                f"an offloaded layer ran before post_init() (state {self._state.value})",
                name="state", value=self._state.value,
            )
        return self._position_of.get(layer)

    def wait_layer(self, layer: int) -> None:
        """Before `layer` runs: make the compute stream wait for its weights' copy (called
        by the custom op). Nothing to do for a layer the revised plan no longer offloads."""
        position = self._position(layer)
        if position is not None:
            self._wait_at(position, self._rt.is_capturing())

    def _wait_at(self, position: int, capturing: bool) -> None:
        """`wait_layer` of the layer at schedule `position`, `capturing` as the runtime says."""
        if position == 0:
            self._steps += 1
            if self._step_log.active:
                self._step_log.step(self._steps, self.stats)
        if capturing:
            self._check_capturable()
        for param, pointer, dtype in self._bound[position]:
            if param.data_ptr() != pointer or param.dtype != dtype:
                self._refuse_changed(position, param)
        expected, self._expected = self._expected, (position + 1) % len(self._copies)
        if (position != expected or self._recovering
                or (position not in self._landed and position not in self._pending)):
            self._realign(position, expected, capturing)
        if position in self._landed:
            self._landed.discard(position)
            return
        done, in_capture = self._pending.pop(position)
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

    def _refuse_changed(self, position: int, param: nn.Parameter) -> None:
        layer = self._plan.offloaded_layers[position]
        name = next((n for n, q in self._layers[layer].named_parameters(remove_duplicate=False) if q is param), "?")
        raise ExecutionError(
            f"layer {layer} parameter {name!r} no longer points at its static buffer: it was changed after "
            f"post_init (now {param.dtype}, {tuple(param.shape)}; e.g. by model.to(), or a tensor assigned to "
            "it), and the copies would fill a buffer it does not read. Call restore() first (it keeps the new "
            "data), make the change, then offload again",
            name=name, value=layer,
        )

    def _realign(self, position: int, expected: int, capturing: bool) -> None:
        """`position` runs when the schedule expected `expected` (a forward stopped part
        way, layers were skipped or run out of order or twice), or while realigning: put
        the schedule right so that the weights are correct, whatever the order.

        At the first position a new step begins: everything in flight is finished and the
        step's first copies are issued as `post_init` does, and prefetching goes on. At any
        other position the layer gets its own copy now (the compute stream waits for it),
        and so does every later one until the next step begins; nothing is prefetched
        meanwhile. Each realignment is counted (`stats().realignments`) and logged.

        Raises:
            ExecutionError: inside a CUDA graph capture (the order must be the eager one).
        """
        layers = self._plan.offloaded_layers
        if capturing:
            raise ExecutionError(
                f"offloaded layer {layers[position]} ran out of order inside a CUDA graph capture (layer "
                f"{layers[expected]} was next): capture a forward that runs every offloaded layer once, in order",
                name="position", value=position,
            )
        if not self._recovering:
            self._realignments += 1
            log.info("offloaded layer %d ran %s: schedule realigned (%s)", layers[position],
                     "without a copy in flight" if position == expected else f"when layer {layers[expected]} was next",
                     "new step" if position == 0 else "copies on demand until the next step")
        self._rt.synchronize()
        self._pending.clear()
        self._landed.clear()
        if position == 0:
            self._recovering = False
            for first in self._plan.schedule.initial:
                self._issue(first, self._record(), in_capture=False)
            if 0 not in self._pending:  # not a prefetched position at step start: copy it now
                self._issue(0, self._record(), in_capture=False)
            return
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

    # ---- CUDA graphs ----------------------------------------------------------------

    def sync_prev_onload(self) -> None:
        """Before capture or replay: block until every copy issued so far is done.

        Raises:
            ExecutionError: called before `post_init`.
        """
        if self._state is not Lifecycle.READY:
            raise ExecutionError(f"sync_prev_onload needs post_init first (state {self._state.value})",
                                 name="state", value=self._state.value)
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

        Raises:
            ExecutionError: nothing to restore (never wrapped, or already restored), or a
                device copy failed.
        """
        if self._state not in (Lifecycle.WRAPPED, Lifecycle.READY):
            raise ExecutionError(f"restore needs a wrapped model (state {self._state.value})",
                                 name="state", value=self._state.value)
        try:
            self._rt.synchronize()
        except BaseException as exc:
            raise_as_execution_error(exc, "restore could not wait for the device, nothing restored", "restore")
        restorer = self._restorer
        if restorer is None:
            raise ExecutionError("restore has nothing to give back (wrap_modules did not finish)",
                                 name="state", value=self._state.value)
        # The buffers go first (the device then holds no slot while weights come back to
        # it), and nothing here keeps a host copy the restorer releases (the host then
        # holds each weight once). Until restore finishes the model must not run.
        if not restorer.started:
            slots = (t for slots in self._buffers.values() for t in slots.values())
            take_replacements(self._plan, self._layers, self._host, held_storages(self._host, slots), self._rt)
        self._drop_buffers()
        restorer.run(self._plan)
        for index, previous in self._patched.items():
            unpatch_forward(self._layers[index], previous)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        ops.unregister(self._handle)
        self._patched.clear()
        self._host.clear()
        try:
            self._rt.synchronize()  # gives back page-locked memory whose last tensor just died
        except BaseException as exc:
            raise_as_execution_error(exc, "restore gave every weight back, but waiting for the device failed (call "
                                     "restore() again to finish)", "restore")
        unmark(self._layers)
        self._state = Lifecycle.RESTORED
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
        if self._state not in (Lifecycle.WRAPPED, Lifecycle.READY):
            raise ExecutionError(f"check needs a wrapped model (state {self._state.value})",
                                 name="state", value=self._state.value)
        slots = [t for buffers in self._buffers.values() for t in buffers.values()]
        return inspect_params(self._plan, self._layers, self._rt, ready=self._state is Lifecycle.READY,
                              slots=slots, hosts=self._host.tensors())

    def log_stats_every(self, steps: int | None = None, seconds: float | None = None) -> None:
        """Log one line of `stats()` (logger ``offload.stats``, INFO) every `steps` forward
        steps and/or every `seconds` seconds (checked at each step); no arguments: stop.

        Raises:
            ExecutionError: `steps` or `seconds` is not a positive number.
        """
        self._step_log.configure(steps, seconds)

    def _host_of(self, ref: Ref) -> torch.Tensor:
        return host_of(self._host, ref)
