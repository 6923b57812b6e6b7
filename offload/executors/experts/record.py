"""Recording the routing of a model's experts modules from its forwards
(`record_routing`): how often each expert ran (`RoutingProfile`, for
`OffloadConfig.routing_profile`) and which experts ran at each call (`RoutingTrace`, for
`offload.pure.experts.replay`). It works on a resident model and on an offloaded one alike
(it reads the modules' inputs, before any cache serves them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload.errors import PlanError
from offload.model.describe import describe_layers
from offload.pure.experts.values import RoutingProfile, RoutingTrace
from offload.pure.spec.experts import ExpertGroup, Routing

__all__ = ["RoutingRecord", "record_routing"]


@final
class RoutingRecord:
    """What `record_routing` saw: per experts module, the experts each call routed and the
    tokens each expert got."""

    def __init__(self, groups: tuple[ExpertGroup, ...]) -> None:
        self.groups = groups
        self._calls: list[list[tuple[int, ...]]] = [[] for _ in groups]
        self._tokens: list[list[int]] = [[0] * g.num_experts for g in groups]

    def saw(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        group = self.groups[index]
        e = group.num_experts
        if group.routing is Routing.INDICES:
            given = args[1] if len(args) > 1 else next(iter(list(kwargs.values())[1:]), None)
            if not isinstance(given, torch.Tensor):
                return
            flat = given.reshape(-1).to(torch.long)
            counts = torch.bincount(flat.clamp(0, e - 1), minlength=e)[:e]
        else:
            given = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(given, torch.Tensor) or given.numel() % e:
                return
            counts = given.reshape(e, -1, given.shape[-1]).ne(0).any(dim=-1).sum(dim=1)
        per_expert = [int(c) for c in counts.tolist()]
        self._calls[index].append(tuple(j for j, c in enumerate(per_expert) if c))
        totals = self._tokens[index]
        for j, c in enumerate(per_expert):
            totals[j] += c

    def begin(self, index: int) -> None:
        """A call of a `Routing.CALLS` module's parent: a new call, its experts to come."""
        self._calls[index].append(())

    def called(self, index: int, expert: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Expert `expert` of a `Routing.CALLS` module runs, on the tokens of its input."""
        calls = self._calls[index]
        if not calls:
            calls.append(())
        calls[-1] = tuple(sorted({*calls[-1], expert}))
        given = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(given, torch.Tensor) and given.dim():
            self._tokens[index][expert] += given.numel() // max(given.shape[-1], 1)

    def profile(self) -> RoutingProfile:
        """The tokens routed to each expert of each module."""
        return RoutingProfile(counts=tuple((g.layer, g.module, tuple(t)) for g, t in
                                           zip(self.groups, self._tokens, strict=True)))

    def trace(self) -> RoutingTrace:
        """The experts each call routed, one step per call of every module (as many steps
        as the module called least often)."""
        steps = min((len(calls) for calls in self._calls), default=0)
        return RoutingTrace(groups=self.groups,
                            steps=tuple(tuple(calls[t] for calls in self._calls) for t in range(steps)))


@contextmanager
def record_routing(layers: Sequence[nn.Module]) -> Iterator[RoutingRecord]:
    """Record the routing of the experts modules of `layers` (found as `describe_layers`
    finds them) while the block runs.

    Raises:
        PlanError: `layers` hold no experts module.
    """
    layers = list(layers)
    groups = describe_layers(layers).experts
    if not groups:
        raise PlanError("the layers hold no experts module (none found by shape: see offload.model.experts)",
                        name="layers", value=len(layers))
    record = RoutingRecord(groups)
    handles: list[RemovableHandle] = []
    for index, group in enumerate(groups):
        layer = layers[group.layer]
        module = layer.get_submodule(group.module)
        if group.routing is Routing.CALLS:
            _hook_calls(record, index, layer.get_submodule(group.module.rpartition(".")[0]), module, handles)
            continue

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], index: int = index) -> None:
            record.saw(index, args, kwargs)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _hook_calls(record: RoutingRecord, index: int, parent: nn.Module, experts: nn.Module,
                handles: list[RemovableHandle]) -> None:
    """Hooks for a `Routing.CALLS` module: its parent's call begins a call, each expert's
    call adds the expert."""

    def begin(module: nn.Module, args: tuple[Any, ...]) -> None:
        record.begin(index)

    handles.append(parent.register_forward_pre_hook(begin))
    for expert, child in enumerate(experts.children()):

        def called(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], expert: int = expert) -> None:
            record.called(index, expert, args, kwargs)

        handles.append(child.register_forward_pre_hook(called, with_kwargs=True))
