"""What a prefetch offloader does when the weights change under it: the per-layer check of
what post_init bound (`offload.executors.bound`), conversions made on the host copies
(`model.to()`, Note [conversions]), and new weights written into the host copies
(`load_weights`, ``load_state_dict`` routed, Note [new weights])."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.bound import compile_check
from offload.executors.common import Ref, find_parameter, normal_tensors, patch_forward
from offload.executors.conversions import converting_apply, same_memory
from offload.executors.lifecycle import Lifecycle
from offload.executors.prefetch.forward import ForwardPath
from offload.executors.reload import Weights, begin_load, log_loaded, refuse_read_only, write_weights
from offload.pure.plan.plan import ParamPlan

__all__ = ["NewWeights"]


class NewWeights(ForwardPath):
    """The bound check, conversions, and new weights."""

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
        self._renewing = {}
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

    def _slots_written(self) -> tuple[tuple[int, str], ...]:
        """The prefetched parameters whose slot holds other values than their host copy,
        among the positions whose slot holds their weights now (a copy issued for them
        and not yet run, or kept): written in place through an alias of the slot, such as
        ``param.data.copy_()``, which moves no version counter (Note [new weights]); the
        next copy into the slot loses them. Waits for the copies in flight. Disk
        positions are not compared (their host copies are their files), nor is anything
        during a CUDA graph capture."""
        if self._rt.is_capturing():
            return ()
        self._rt.synchronize()
        disk = self._disk
        found: list[tuple[int, str]] = []
        for position in sorted(self._pending):
            if disk is not None and disk.on_disk(position):
                continue
            layer = self._plan.offloaded_layers[position]
            for (_, _, param, pointer, _), name in zip(self._bound[position], self._bound_names[position], strict=True):
                if (layer, name) in self._experts.refs:
                    continue  # its slot holds only the experts routed last (Note [expert cache])
                entry = self._convert_from.get(id(param))
                if entry is None or param.data_ptr() != pointer:
                    continue  # replaced or moved: the bound check refuses it at the next forward
                host = self._host_of(entry[1])
                data = param.data
                if data.dtype != host.dtype or data.shape != host.shape:
                    continue
                if not torch.equal(data, host.to(data.device)):
                    found.append((self._plan.offloaded_layers[position], name))
        return tuple(found)

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
        """Make conversions of the offloaded parameters convert their host copies, wherever
        the call starts (the model, the stack, a layer or a part of it): each module holding
        an offloaded parameter gets an instance ``_apply`` (Note [conversions]; and
        `restore` would otherwise keep a slot that holds another layer's weights)."""
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

    @normal_tensors
    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """Give the model new weights without restoring it (`offload.executors.reload`,
        Note [new weights]):
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
        disk = self._disk
        before = {(p.layer, p.name): self._host.get((p.layer, p.name)) for p in disk.tier.params} if disk else {}
        try:
            loaded = write_weights(weights, self._plan, self._layers, self._host, prefix=prefix,
                                   skip_read_only=skip_read_only, new_copies=disk)
        except BaseException:
            self._point_at_new_copies(before)
            self._reloaded()  # what was written is what the model computes with
            raise
        self._point_at_new_copies(before)
        self._reloaded()
        log_loaded(loaded)

    def _point_at_new_copies(self, before: Mapping[Ref, torch.Tensor | None]) -> None:
        """Before post_init the offloaded parameters point at their host copies: those of
        disk parameters that took new copies (`before`: the copies they had) point at the
        new ones (post_init would otherwise take the old one back as replaced data)."""
        if self._state is not Lifecycle.WRAPPED or not before:
            return
        for p in self._plan.offloaded_params:
            owner = p.tied_to or (p.layer, p.name)
            old, new = before.get(owner), self._host.get(owner)
            if old is None or new is None or new is old or not old.numel():
                continue
            param = find_parameter(self._layers[p.layer], p.name)
            if param is not None and param.numel() and param.data_ptr() == old.data_ptr():
                param.data = new

    def _route_begin(self, holder: nn.Module) -> None:
        """``load_state_dict`` reaches `holder`: point its offloaded parameters at their
        host copies, so that torch writes the new values there (see `route_state_dict_loads`;
        Note [new weights])."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return  # before post_init the parameters point at their host copies already
        live = [(param, owner) for leaf, param, owner, *_ in entry[1] if holder._parameters.get(leaf) is param]
        disk = self._disk
        renew = {id(param) for param, owner in live if disk is not None and disk.takes(owner)}
        for param, owner in live:
            refusal = disk.refusal(owner) if disk is not None and id(param) in renew else None
            if refusal is not None:
                raise ExecutionError(f"load_state_dict: layer {owner[0]} parameter {owner[1]!r} cannot take new "
                                     f"weights: {refusal}", name=owner[1], value=owner[0])
        refuse_read_only(self._host, (owner for param, owner in live if id(param) not in renew), "load_state_dict")
        self._rt.synchronize()  # copies in flight read the host copies about to be written
        for param, owner in live:
            host = self._host_of(owner)
            if id(param) in renew:
                # A disk copy is not written in place: torch writes a host tensor holding its
                # values (so a load that stops part way leaves them), `_route_end` spills it.
                values = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype)
                values.copy_(host)
                self._renewing[id(param)] = (param, owner, values, param._version)
                host = values
            param.data = host

    def _route_end(self, holder: nn.Module) -> None:
        """`holder`'s part of ``load_state_dict`` is done: its parameters point at their
        slots again, their writes are accepted, and the slots are refilled before the
        next forward or replay (`_reload_due`)."""
        entry = self._held.get(id(holder))
        if entry is None or self._state is not Lifecycle.READY:
            return
        renewing = [self._renewing.pop(id(param)) for _, param, *_ in entry[1] if id(param) in self._renewing]
        written = [(owner, values) for param, owner, values, version in renewing
                   if param._version != version and same_memory(param.data, values)]
        failed: ExecutionError | None = None
        if written and self._disk is not None:
            try:
                self._disk.replace(self._host, written)  # new copies in the spill file (Note [new weights])
            except ExecutionError as exc:
                failed = exc
        changed: set[int] = set()
        for leaf, param, owner, slot in entry[1]:
            if holder._parameters.get(leaf) is param and (same_memory(param.data, self._host_of(owner)) or any(
                    same_memory(param.data, values) for _, _, values, _ in renewing)):
                param.data = slot
                for position, index in self._entries_of[id(param)]:  # every name it has (a tie)
                    params, name, _, pointer, _ = self._bound[position][index]
                    self._bound[position][index] = (params, name, param, pointer, param._version)
                    changed.add(position)
        self._compile_checks(sorted(changed))
        # The cycles whose host copies changed: their next position realigns, refilling
        # their slots (not a realignment: Note [new weights]); the others go on.
        for cycle in {self._cycle_of[position] for position in changed}:
            self._reload_due.add(cycle)
            self._expected[cycle] = -1
        if changed:
            self._experts.reset()  # their slots hold the old weights (Note [expert cache])
        if failed is not None:
            raise ExecutionError(f"load_state_dict: the new values of {len(written)} disk-tier weights could not be "
                                 f"written to the spill file, they keep their old ones: {failed}", name=failed.name,
                                 value=failed.value) from failed

    def _reloaded(self) -> None:
        """After host copies were written: accept the parameters' version counters as
        they are, and fill the slots afresh (after post_init)."""
        if self._state is not Lifecycle.READY:
            return
        self._accept_versions()
        self._refill()
        self._experts.reset()  # their slots hold the old weights (Note [expert cache])
