"""`ExpertCaches`: the expert caches of a prefetch offloader (Note [expert cache]): one
`_Cache` per experts module, its forward patched to serve the routed experts before the
module runs."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref, patch_forward, unpatch_forward
from offload.logs import logger
from offload.protocols import Event, Runtime
from offload.pure.check import LiveCheck
from offload.pure.experts.policy import CacheState, admit, initial_state
from offload.pure.experts.values import ExpertCachePlan, served_refs
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import contiguous_stride
from offload.pure.stats import ExpertCounts

__all__ = ["ExpertCaches"]

log = logger("offload.prefetch")


def _runs(experts: Sequence[int]) -> list[tuple[int, int]]:
    """`experts` (sorted) as runs of consecutive indices, ``(first, stop)`` each."""
    out: list[tuple[int, int]] = []
    for e in experts:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def _indices_argument(module: nn.Module) -> str | None:
    """The name of the forward's second input (the routing indices), for a keyword call."""
    try:
        inputs = list(inspect.signature(type(module).forward).parameters)[1:]  # after self
    except (TypeError, ValueError):
        return None
    return inputs[1] if len(inputs) > 1 else None


#: A parameter kind's E rows: the fused tensor (expert j its row j), or, for a `Routing.CALLS`
#: module, the E experts' own tensors.
Rows = torch.Tensor | list[torch.Tensor]


@final
class _Cache:
    """One experts module's cache: its slot rows (``rows[i]``, the slot buffers of its i-th
    kind of parameter, E rows), host copies (``hosts[i]``, the same) and cache slots
    (``slots[i]``, C rows)."""

    def __init__(self, plan: ExpertCachePlan, rt: Runtime, rows: list[Rows], hosts: list[Rows],
                 slots: list[torch.Tensor]) -> None:
        self.plan = plan
        self._rt = rt
        self.rows = rows
        self.hosts = hosts
        self.slots = slots
        self.state: CacheState = initial_state(plan)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.copies = 0
        self.bytes_copied = 0
        self.row_bytes = [h[0].numel() * h[0].element_size() if len(h) else 0 for h in hosts]

    def load_held(self) -> None:
        """Fill the held experts' slots from their host copies (post_init, new weights)."""
        self.state = initial_state(self.plan)
        for expert, slot in self.state.residents:
            for host, cache in zip(self.hosts, self.slots, strict=True):
                self._rt.wait(self._rt.copy_after(cache[slot], host[expert], self._rt.record()))

    def serve(self, routed: tuple[int, ...]) -> None:
        """Put every routed expert's weights in its rows (Note [expert cache])."""
        access = admit(self.plan, self.state, routed)
        self.state = access.state
        self.hits += len(access.hits)
        self.misses += len(access.misses)
        self.evictions += len(access.evicted)
        done: Event | None = None
        if access.misses:
            after: Event | None = self._rt.record()
            for first, stop in _runs(sorted(e for e, _ in access.misses)):
                for i, (row, host) in enumerate(zip(self.rows, self.hosts, strict=True)):
                    if isinstance(row, torch.Tensor) and isinstance(host, torch.Tensor):
                        done = self._rt.copy_after(row[first:stop], host[first:stop], after)
                        self.copies += 1
                    else:  # one tensor per expert (not fused)
                        for expert in range(first, stop):
                            done = self._rt.copy_after(row[expert], host[expert], after)
                        self.copies += stop - first
                    self.bytes_copied += (stop - first) * self.row_bytes[i]
        # The hits' device copies go on the compute stream while the misses' copies run on
        # the copy stream: other rows, and no hit's slot is evicted by this call.
        for expert, slot in access.hits:
            for row, cache in zip(self.rows, self.slots, strict=True):
                row[expert].copy_(cache[slot])
        if done is not None:
            self._rt.wait(done)  # before the module reads the rows, and a kept miss's row is read
        for expert, kept in access.misses:
            if kept is not None:
                for row, cache in zip(self.rows, self.slots, strict=True):
                    cache[kept].copy_(row[expert])

    def counts(self) -> ExpertCounts:
        return ExpertCounts(layer=self.plan.layer, module=self.plan.group.module, hits=self.hits,
                            misses=self.misses, evictions=self.evictions, bytes_copied=self.bytes_copied)


def _refuse_capture(rt: Runtime, group: ExpertGroup, how: str) -> None:
    if rt.is_capturing():
        raise ExecutionError(f"layer {group.layer} {group.module}: its experts are copied {how}, which a CUDA graph "
                             "cannot capture; offload it with expert_cache=False to capture it", name=group.module,
                             value=group.layer)


def _compiled_around(serving_forward: Callable[..., Any]) -> Callable[..., Any]:
    """`serving_forward` with torch.compile breaking its graph there: the copies depend on
    the routing (Note [expert cache])."""
    disabled: Callable[..., Any] = torch.compiler.disable(serving_forward)  # type: ignore[no-untyped-call]  # unannotated in torch
    return disabled


def _per_kind(group: ExpertGroup, tensors: list[torch.Tensor]) -> list[Rows]:
    """`tensors`, one per parameter of `group` in its order, as `_Cache` holds them: one per
    kind where fused, else each kind's E experts' tensors (kind i of expert j is
    ``params[j * kinds + i]``)."""
    k = group.kinds
    return list(tensors) if group.fused else [tensors[i::k] for i in range(k)]


def _host_rows(group: ExpertGroup, hosts: Callable[[Ref], torch.Tensor]) -> list[Rows]:
    """The host copies of `group`'s parameters, per kind (`_Cache`)."""
    return _per_kind(group, [hosts((group.layer, name)) for name in group.params])


def _routed_by_indices(layer: int, module: str, experts: int, indices: object) -> tuple[int, ...]:
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.is_complex():
        raise ExecutionError(f"layer {layer} {module}: the experts module was called without integer routing "
                             f"indices (got {type(indices).__name__})", name=module, value=layer)
    routed = tuple(int(e) for e in torch.unique(indices).tolist()) if indices.numel() else ()
    if routed and (routed[0] < 0 or routed[-1] >= experts):
        bad = routed[0] if routed[0] < 0 else routed[-1]
        raise ExecutionError(f"layer {layer} {module}: routing index {bad} is outside the {experts} experts "
                             f"(0 to {experts - 1}); nothing was read", name=module, value=bad)
    return routed


def _routed_by_scores(layer: int, module: str, experts: int, hidden: object) -> tuple[int, ...]:
    if not isinstance(hidden, torch.Tensor) or hidden.numel() % experts:
        raise ExecutionError(f"layer {layer} {module}: the experts module's input is not {experts} blocks of tokens "
                             f"(got {getattr(hidden, 'shape', type(hidden).__name__)})", name=module, value=layer)
    blocks = hidden.reshape(experts, -1)
    return tuple(int(e) for e in torch.nonzero(blocks.any(dim=1)).flatten().tolist())


@final
class ExpertCaches:
    """The expert caches of one offloader (Note [expert cache]).

    Args:
        plans: the plan's expert caches (`OffloadPlan.experts`).
        rt: the runtime the copies go through.
    """

    def __init__(self, plans: Sequence[ExpertCachePlan], rt: Runtime) -> None:
        self._plans = tuple(plans)
        self._rt = rt
        self._caches: list[_Cache] = []
        self._patched: list[tuple[nn.Module, Callable[..., Any] | None]] = []
        self.refs: frozenset[Ref] = served_refs(self._plans)
        self._rows: dict[Ref, torch.Tensor] = {}
        self._hosts: Callable[[Ref], torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        """Whether caches are installed."""
        return bool(self._caches)

    def take(self, ref: Ref, buffer: torch.Tensor) -> bool:
        """Whether `ref` is an expert parameter, its slot buffer (E rows) then kept for
        `install`: the copy queue leaves it alone (post_init)."""
        if ref not in self.refs:
            return False
        self._rows[ref] = buffer
        return True

    def install(self, layers: Sequence[nn.Module], hosts: Callable[[Ref], torch.Tensor]) -> None:
        """Zero the slot rows (`take`), allocate each cache's slots, fill the held
        experts, patch each experts module's forward (post_init).

        Args:
            layers: the offloader's layers.
            hosts: each expert parameter's host copy (E rows).
        """
        self._hosts = hosts
        for plan in self._plans:
            group = plan.group
            refs = [(group.layer, name) for name in group.params]
            buffers = [self._rows[ref] for ref in refs]
            for buffer in buffers:
                buffer.zero_()  # rows the module reads and no expert was copied to hold finite values
            module = layers[group.layer].get_submodule(group.module)
            if group.fused:
                slots = [self._rt.device_empty((plan.slots, *b.shape[1:]), tuple(b.stride()), b.dtype)
                         for b in buffers]
            else:  # one expert's shape per kind
                slots = [self._rt.device_empty((plan.slots, *b.shape), contiguous_stride((plan.slots, *b.shape)), b.dtype)
                         for b in buffers[:group.kinds]]
            cache = _Cache(plan, self._rt, _per_kind(group, buffers), _host_rows(group, hosts), slots)
            cache.load_held()
            self._caches.append(cache)
            if group.fused:
                self._patched.append((module, patch_forward(module, functools.partial(self._serving, cache, module))))
            else:  # each expert served when it is called
                for expert, child in enumerate(module.children()):
                    self._patched.append((child, patch_forward(child, functools.partial(self._serving_one, cache,
                                                                                       expert))))
        if self._caches:
            log.info("expert caches on %d experts modules: %s slots", len(self._caches),
                     ", ".join(sorted({str(c.plan.slots) for c in self._caches})))

    def _serving(self, cache: _Cache, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        plan = cache.plan
        group = plan.group
        name = _indices_argument(module)
        rt = self._rt

        def serving_forward(*args: Any, **kwargs: Any) -> Any:
            _refuse_capture(rt, group, "as the routing asks")
            if group.routing is Routing.INDICES:
                indices = args[1] if len(args) > 1 else kwargs.get(name or "", None)
                routed = _routed_by_indices(group.layer, group.module, group.num_experts, indices)
            else:
                hidden = args[0] if args else next(iter(kwargs.values()), None)
                routed = _routed_by_scores(group.layer, group.module, group.num_experts, hidden)
            cache.serve(routed)
            return forward(*args, **kwargs)

        return _compiled_around(serving_forward)

    def _serving_one(self, cache: _Cache, expert: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The forward of expert `expert` of a `Routing.CALLS` module: served, then run."""
        group = cache.plan.group
        rt = self._rt

        def serving_forward(*args: Any, **kwargs: Any) -> Any:
            _refuse_capture(rt, group, "as they are called")
            cache.serve((expert,))
            return forward(*args, **kwargs)

        return _compiled_around(serving_forward)

    def reset(self) -> None:
        """New weights: every cache forgets its residents, takes its parameters' host copies
        as they are now (a disk-tier weight's new copy is another file's), and refills its
        held experts."""
        for cache in self._caches:
            if self._hosts is not None:
                cache.hosts = _host_rows(cache.plan.group, self._hosts)
            cache.load_held()

    def remove(self) -> None:
        """Unpatch the modules and let go of the caches (restore, a failed post_init)."""
        for module, previous in reversed(self._patched):
            unpatch_forward(module, previous)
        self._patched = []
        self._caches = []
        self._rows = {}
        self._hosts = None

    def counts(self) -> tuple[ExpertCounts, ...]:
        """Each cache's counters."""
        return tuple(c.counts() for c in self._caches)

    def copied(self) -> tuple[int, int]:
        """(copies issued, bytes copied) from host copies, over all caches."""
        return sum(c.copies for c in self._caches), sum(c.bytes_copied for c in self._caches)

    def checked(self, found: LiveCheck) -> LiveCheck:
        """`found` with each cache's residents (`LiveCheck.expert_residents`) and their
        slots' device bytes counted in `device_bytes_held`."""
        residents = tuple((c.plan.layer, c.plan.group.module, tuple(sorted(e for e, _ in c.state.residents)))
                          for c in self._caches)
        return attrs.evolve(found, expert_residents=residents,
                            device_bytes_held=found.device_bytes_held + self.slot_bytes())

    def slot_bytes(self) -> int:
        """Device bytes of every cache's slots."""
        return sum(t.untyped_storage().nbytes() for c in self._caches for t in c.slots)
