"""Small expert groups, cache plans and routing for the expert-cache tests, as builders
and hypothesis strategies (E up to 8, so that the oracles can enumerate)."""

from __future__ import annotations

from hypothesis import strategies as st

from offload.pure.experts.values import CachePolicy, ExpertCachePlan, RoutingTrace
from offload.pure.spec.experts import ExpertGroup, Routing

__all__ = ["cache_cases", "group", "plan", "routed_calls", "trace_of"]


def group(num_experts: int, *, layer: int = 0, expert_bytes: int = 1000, module: str = "mlp.experts") -> ExpertGroup:
    """An experts module of `num_experts` experts of `expert_bytes` each."""
    return ExpertGroup(layer=layer, module=module, num_experts=num_experts, params=(f"{module}.gate_up_proj",),
                       expert_bytes=expert_bytes, routing=Routing.INDICES)


def plan(num_experts: int, slots: int, *, held: tuple[int, ...] = (), policy: CachePolicy = CachePolicy.LRU,
         layer: int = 0, expert_bytes: int = 1000) -> ExpertCachePlan:
    """The cache plan of one such module."""
    return ExpertCachePlan(group=group(num_experts, layer=layer, expert_bytes=expert_bytes), slots=slots, held=held,
                           policy=policy)


def trace_of(plans: tuple[ExpertCachePlan, ...], calls: tuple[tuple[tuple[int, ...], ...], ...]) -> RoutingTrace:
    """The trace of `plans`' groups whose step t routes ``calls[t]``."""
    return RoutingTrace(groups=tuple(p.group for p in plans), steps=calls)


def routed_calls(num_experts: int, max_calls: int) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    """Up to `max_calls` calls, each a sorted distinct tuple of experts (possibly empty)."""
    call = st.sets(st.integers(0, num_experts - 1)).map(lambda s: tuple(sorted(s)))
    return st.lists(call, max_size=max_calls).map(tuple)


@st.composite
def cache_cases(draw: st.DrawFn, max_experts: int = 8, max_calls: int = 16,
                policies: tuple[CachePolicy, ...] = tuple(CachePolicy)
                ) -> tuple[ExpertCachePlan, tuple[tuple[int, ...], ...]]:
    """A cache plan (any E, C, held experts, policy) and calls to run through it."""
    e = draw(st.integers(2, max_experts))
    c = draw(st.integers(1, e))
    held = tuple(sorted(draw(st.sets(st.integers(0, e - 1), max_size=c))))
    cache = plan(e, c, held=held, policy=draw(st.sampled_from(policies)), layer=draw(st.integers(0, 3)),
                 expert_bytes=draw(st.integers(1, 1 << 20)))
    return cache, draw(routed_calls(e, max_calls))
