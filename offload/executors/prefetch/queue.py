"""The copy queue of a prefetch offloader: copies issued on the copy stream after the
layer whose slot they overwrite, waited for before the layer that reads them, and the
schedule put right when layers run out of order. The rules it keeps are the package's
notes: Note [ordering], Note [in flight], Note [kept position], Note [capture boundary],
Note [realign], Note [compiled then eager]."""

from __future__ import annotations

from typing import NoReturn

from offload.errors import ExecutionError
from offload.executors.bound import compile_check, first_changed
from offload.executors.common import raise_as_execution_error
from offload.executors.lifecycle import Lifecycle, refuse, require
from offload.executors.prefetch.state import PrefetchState
from offload.logs import logger
from offload.protocols import Event

__all__ = ["CopyQueue"]

log = logger("offload.prefetch")


class CopyQueue(PrefetchState):
    """Issue, wait, realign (see the module docstring)."""

    def _issue(self, position: int, after: Event, *, in_capture: bool) -> None:
        """Issue `position`'s copies on the copy stream after `after` (Note [ordering]) and
        put it in flight (Note [in flight])."""
        done: Event = after
        first = True
        copy = self._copy
        disk = self._disk if self._disk is not None and self._disk.on_disk(position) else None
        try:
            if disk is not None:  # its staging buffer must hold it first (Note [disk tier])
                disk.before_copy(position)
            for chunks in self._copies[position]:
                done = copy(chunks, after if first else None)
                first = False
                self._copies_issued += 1
            if disk is not None:
                disk.after_copy(position, done)
        except BaseException as exc:
            if disk is not None and not first:
                # Chunks already issued read the staging buffer: no refill before they land.
                disk.note_copy(position, done)
            # No entry for the position: the layer that needs it realigns (copies it again).
            raise_as_execution_error(
                exc, f"copying offloaded layer {self._plan.offloaded_layers[position]}'s weights failed", "forward")
        self._bytes_copied += self._copy_bytes[position]
        if not in_capture:
            self._timed_bytes += self._copy_bytes[position]
        self._pending[position] = (done, in_capture)
        self._landed.discard(position)

    def _check_capturable(self) -> None:
        """Refuse a capture from pageable host copies (Note [capture boundary]), or with a
        disk tier (Note [disk tier])."""
        if self._disk is not None:
            raise ExecutionError(
                "cannot capture a CUDA graph of a model with a disk tier: its reads run on host threads between "
                "the copies, and a replay would copy staging buffers nothing refilled. Run it without CUDA graphs "
                "(torch.compile works), or plan without the disk tier",
                name="disk", value=len(self._disk.tier.disk_positions))
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
        self._ops_ran = True  # (Note [compiled then eager])
        if position is not None:
            self._wait_at(position, self._rt.is_capturing(), eager=False)

    def _wait_at(self, position: int, capturing: bool, eager: bool = True) -> None:
        """`wait_layer` of the layer at schedule `position`, `capturing` as the runtime
        says; `eager`: the layer is called directly, not through the custom ops."""
        cycle = self._cycle_of[position]  # its stack's cycle (Note [cycles])
        if position == self._cycle_first[cycle]:  # a run of a stack begins: a step
            if self._step_log.active and self._steps:
                self._step_log.step(self._steps, self.stats)  # the steps finished so far, their copies counted
            self._steps += 1
            if self._disk is not None:
                self._disk.run_begins(cycle)  # staging follows the order the stacks run (Note [disk tier])
        if capturing:
            self._check_capturable()
        # Each offloaded parameter is still the one its module holds, still points at its
        # slot, and was not written in place (its version counter; not under the ops,
        # whose declared mutations of the slot tensors move it: see `offload.executors.ops`).
        if not (self._checks[position] if eager else self._checks_traced[position])():
            if eager and self._ops_ran and self._checks_traced[position]():
                self._accept_versions()  # only the compiled path's ops moved them (Note [compiled then eager])
            else:
                self._refuse_changed(position, eager)
        expected = self._expected[cycle]
        self._expected[cycle] = self._successor[position]
        if position != expected or (self._recovering and cycle in self._recovering):
            self._realign(position, expected, capturing)
        entry = self._pending.pop(position, None)
        if entry is None:
            if position in self._landed:  # its copy was joined at the end of a capture (Note [capture boundary])
                self._landed.discard(position)
                return
            self._realign(position, expected, capturing)  # no copy in flight for it (Note [in flight])
            entry = self._pending.pop(position)
        if self._kept[position]:
            # It keeps its one copy's event (Note [kept position]).
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
        # waited on (Note [capture boundary]).

    def _accept_versions(self) -> None:
        """Take every bound parameter's version counter as it is now: after new weights
        were written, or after compiled forwards whose ops moved them (Note [compiled then
        eager])."""
        self._bound = [[(params, leaf, param, pointer, param._version) for params, leaf, param, pointer, _ in entries]
                       for entries in self._bound]
        self._checks = [compile_check(entries, versions=True) for entries in self._bound]
        self._ops_ran = False

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
        the schedule right so that the weights are correct, whatever the order (Note [realign]).

        At the first position of its cycle a new step of the cycle begins: everything in
        flight is finished and the cycle's first copies are issued as `post_init` does, and
        prefetching goes on. At any other position the layer gets its own copy now (the
        compute stream waits for it), and so does every later one of its cycle until the
        cycle's next step begins; nothing is prefetched for that cycle meanwhile (other
        cycles go on: Note [cycles]). Each realignment is counted (`stats().realignments`) and logged;
        refilling the slots after ``load_state_dict`` is not a realignment.

        Raises:
            ExecutionError: inside a CUDA graph capture (the order must be the eager one).
        """
        layers = self._plan.offloaded_layers
        cycle = self._cycle_of[position]
        first = self._cycle_first[cycle]
        # After load_state_dict wrote host copies (`_route_end`) every slot is refilled
        # the same way: that is not counted as a realignment.
        reloaded = cycle in self._reload_due
        self._reload_due.discard(cycle)
        if capturing:
            raise ExecutionError(
                f"offloaded layer {layers[position]} ran out of order inside a CUDA graph capture (layer "
                f"{layers[expected if expected >= 0 else first]} was next, or weights were loaded and sync_prev_onload "
                "was not called before the capture): capture a forward that runs each of its stacks' offloaded "
                "layers once, in order",
                name="position", value=position,
            )
        if reloaded:
            log.debug("offloaded layer %d: slots refilled after load_state_dict", layers[position])
        elif cycle not in self._recovering:
            self._realignments += 1
            log.info("offloaded layer %d ran %s: schedule realigned (%s)", layers[position],
                     "without a copy in flight" if position == expected else
                     f"when layer {layers[expected if expected >= 0 else first]} was next",
                     "new step" if position == first else "copies on demand until the next step")
        self._rt.synchronize()
        if position == first:
            self._restart(cycle)
            if position not in self._pending:  # not a prefetched position at step start: copy it now
                self._issue(position, self._record(), in_capture=False)
            return
        self._forget(cycle)
        self._recovering.add(cycle)
        self._issue(position, self._record(), in_capture=False)

    def start_after_layer(self, layer: int) -> None:
        """After `layer` ran: issue the copy the schedule names next (called by the op);
        nothing while the schedule is being realigned."""
        position = self._position(layer)
        self._ops_ran = True  # (Note [compiled then eager])
        if position is not None and not (self._recovering and self._cycle_of[position] in self._recovering):
            self._start_at(position, self._rt.is_capturing())

    def _start_at(self, position: int, capturing: bool) -> None:
        """`start_after_layer` of the layer at schedule `position` (not while realigning):
        the copy the schedule names after it (Note [ordering])."""
        target = self._next_after[position]
        if target is None:
            return
        if capturing:
            self._check_capturable()
        self._issue(target, self._record(), in_capture=capturing)

    def _refill(self) -> None:
        """The host copies changed: the next forward is a new step, whose first copies
        are issued now (call with nothing in flight)."""
        self._expected = list(self._cycle_first)
        self._reload_due.clear()
        self._restart()

    def _restart(self, cycle: int | None = None) -> None:
        """Begin a step of `cycle` (None: of every cycle) afresh, as post_init does: nothing
        of it pending or landed, its first copies issued (call with nothing in flight)."""
        cycles = range(len(self._cycle_first)) if cycle is None else (cycle,)
        for c in cycles:
            self._forget(c)
            self._recovering.discard(c)
            for first in self._initial_of[c]:
                self._issue(first, self._record(), in_capture=False)

    def _forget(self, cycle: int) -> None:
        """Nothing of `cycle`'s positions in flight or landed any more (call with nothing in
        flight)."""
        first, stop = self._cycle_ranges[cycle]
        if first == 0 and stop == len(self._cycle_of):
            self._pending.clear()
            self._landed.clear()
            return
        for position in range(first, stop):
            self._pending.pop(position, None)
            self._landed.discard(position)

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
        if self._reload_due or self._recovering or self._expected != list(self._cycle_first):
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

        Those positions then count as landed (Note [capture boundary]). Outside a capture
        nothing of that kind is outstanding and it returns at once.
        """
        for position in sorted(p for p, (_, in_capture) in self._pending.items() if in_capture):
            done, _ = self._pending.pop(position)
            self._rt.wait(done)
            self._landed.add(position)
