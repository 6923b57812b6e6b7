"""What a mixture-of-experts layer holds: its experts module, found by shape, as E experts
of B bytes each (`ExpertGroup`), beside the layer's other (non-expert) weights.

An experts module keeps every expert's weights in tensors with a leading dimension E (the
fused layout of transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], and
gpt-oss's biases [E, X]); expert ``j`` is row ``j`` of each, a contiguous run of bytes. Or
it is a ``ModuleList`` of E expert modules alike (older and custom models: `Routing.CALLS`),
expert ``j`` the parameters of its j-th child. The shell finds them
(`offload.model.experts`); the cache that serves them is planned in `offload.pure.experts`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, non_empty_str, tuple_of

__all__ = ["ExpertGroup", "Routing", "check_groups"]


class Routing(enum.Enum):
    """How an experts module is told which experts run.

    INDICES: ``forward(hidden_states, top_k_index, top_k_weights)``; the experts named in
        ``top_k_index`` run (transformers 5's fused experts, gpt-oss).
    SCORES: ``forward(hidden_states)`` with the input laid out as E blocks of the tokens,
        each scaled by its expert's router score, which is zero for an unrouted expert: the
        experts whose block holds a non-zero run (Llama 4). An unrouted expert's block is
        exact zeros, so its output is exact zeros whatever finite weights its row holds.

    CALLS: a ``ModuleList`` of E expert modules, each called with the tokens routed to it
        by its parent's forward; an expert that is not called does not run. Each call of
        an expert is one call of the cache (`offload.pure.experts.policy.admit` with that
        one expert).
    """

    INDICES = "indices"
    SCORES = "scores"
    CALLS = "calls"


def _names(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    tuple_of(str, PlanError)(instance, attribute, value)
    if not value or len(set(value)) != len(value) or not all(value):
        raise PlanError(f"an expert group needs distinct, non-empty parameter names, got {value!r}",
                        name="params", value=value)


@attrs.frozen(kw_only=True)
class ExpertGroup:
    """One experts module of one layer.

    Attributes:
        layer: the index of its layer in the `ModelSpec`.
        module: the module's dotted path relative to its layer (``mlp.experts``).
        num_experts: E, the experts it holds (2 or more).
        params: its parameters' names relative to the layer (``mlp.experts.gate_up_proj``),
            in ``named_parameters()`` order; each has leading dimension E and rows that
            are contiguous (stride[0] equal to the row's element count). `Routing.CALLS`:
            every expert's parameters, expert by expert (``mlp.experts.0.w1.weight``, ...,
            ``mlp.experts.7.w3.weight``), the same number for each, alike in shape.
        expert_bytes: B, the bytes of one expert over all of `params` (each tensor's
            bytes divided by E).
        routing: how the module is told which experts run.
        top_k: the experts each token is routed to (its router's ``top_k``), 1 to E;
            None where the model does not say. Where known, a call over T tokens routes
            at most min(E, T x top_k) experts: the worst case the step estimate counts
            without a routing trace (`offload.pure.experts.expected.bounded_loads`).
    """

    layer: int = attrs.field(validator=int_at_least(0, PlanError))
    module: str = attrs.field(validator=non_empty_str(PlanError))
    num_experts: int = attrs.field(validator=int_at_least(2, PlanError))
    params: tuple[str, ...] = attrs.field(validator=_names)
    expert_bytes: int = attrs.field(validator=int_at_least(1, PlanError))
    routing: Routing = attrs.field(validator=attrs.validators.instance_of(Routing))
    top_k: int | None = attrs.field(default=None, validator=int_at_least(1, PlanError, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.top_k is not None and self.top_k > self.num_experts:
            raise PlanError(f"expert group {self.layer}:{self.module}: top_k {self.top_k} is above its "
                            f"{self.num_experts} experts", name="top_k", value=self.top_k)

    @property
    def nbytes(self) -> int:
        """Bytes of all its experts: E x B."""
        return self.num_experts * self.expert_bytes

    @property
    def fused(self) -> bool:
        """Whether its parameters hold E rows each (else one expert's parameters each:
        `Routing.CALLS`)."""
        return self.routing is not Routing.CALLS

    @property
    def kinds(self) -> int:
        """The parameters of one expert: all of `params` when fused, else len(params) / E."""
        return len(self.params) if self.fused else len(self.params) // self.num_experts

    def expert_params(self, expert: int) -> tuple[str, ...]:
        """The names of expert `expert`'s own parameters (`Routing.CALLS`)."""
        k = self.kinds
        return self.params[expert * k:(expert + 1) * k]


def check_groups(groups: tuple[ExpertGroup, ...], layers: tuple[Any, ...]) -> None:
    """Raise `PlanError` unless every group matches the layers it names (`LayerSpec`s):
    its layer exists, each of its parameters is in that layer with leading dimension E and
    contiguous rows (`Routing.CALLS`: each expert's parameters under ``module.j.``, alike),
    B is their bytes over E, and no layer holds one module twice.

    Args:
        groups: the expert groups of a model.
        layers: the model's `LayerSpec`s (typed loosely: spec's values import this module).
    """
    seen: set[tuple[int, str]] = set()
    for group in groups:
        where = f"expert group {group.layer}:{group.module}"
        if group.layer >= len(layers):
            raise PlanError(f"{where}: the model has {len(layers)} layers", name="layer", value=group.layer)
        if (group.layer, group.module) in seen:
            raise PlanError(f"{where} is given twice", name="module", value=group.module)
        seen.add((group.layer, group.module))
        by_name = {p.name: p for p in layers[group.layer].params}
        if not group.fused:
            _check_calls(group, by_name, where)
            continue
        total = 0
        for name in group.params:
            param = by_name.get(name)
            if param is None:
                raise PlanError(f"{where}: layer {group.layer} has no parameter {name!r}", name=name,
                                value=group.layer)
            row = 1
            for size in param.shape[1:]:
                row *= size
            if not param.shape or param.shape[0] != group.num_experts or (
                    param.shape[0] > 1 and param.stride[0] != row):
                raise PlanError(f"{where}: parameter {name!r} of shape {param.shape} and stride {param.stride} "
                                f"is not {group.num_experts} contiguous rows", name=name, value=param.shape)
            total += param.nbytes
        if total != group.expert_bytes * group.num_experts:
            raise PlanError(f"{where}: its parameters hold {total} bytes, not {group.num_experts} x "
                            f"{group.expert_bytes}", name="expert_bytes", value=group.expert_bytes)


def _check_calls(group: ExpertGroup, by_name: dict[str, Any], where: str) -> None:
    """A `Routing.CALLS` group: E experts of the same parameters under ``module.j.``, alike
    in shape and dtype, whose bytes over all of them are E x B."""
    e = group.num_experts
    if len(group.params) % e:
        raise PlanError(f"{where}: {len(group.params)} parameters are not the same number for each of {e} experts",
                        name="params", value=len(group.params))
    first: list[tuple[str, tuple[int, ...], str]] = []
    total = 0
    for j in range(e):
        prefix = f"{group.module}.{j}."
        alike = []
        for name in group.expert_params(j):
            param = by_name.get(name)
            if param is None or not name.startswith(prefix):
                raise PlanError(f"{where}: expert {j} has no parameter {name!r} under {prefix!r}", name=name,
                                value=group.layer)
            alike.append((name[len(prefix):], param.shape, param.dtype))
            total += param.nbytes
        if j == 0:
            first = alike
        elif alike != first:
            raise PlanError(f"{where}: expert {j}'s parameters {alike} are not expert 0's {first}", name="params",
                            value=j)
    if total != group.expert_bytes * e:
        raise PlanError(f"{where}: its parameters hold {total} bytes, not {e} x {group.expert_bytes}",
                        name="expert_bytes", value=group.expert_bytes)
