"""What a mixture-of-experts layer holds: its experts module, found by shape, as E experts
of B bytes each (`ExpertGroup`), beside the layer's other (non-expert) weights.

An experts module keeps every expert's weights in tensors with a leading dimension E (the
fused layout of transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], and
gpt-oss's biases [E, X]); expert ``j`` is row ``j`` of each, a contiguous run of bytes. The
shell finds them (`offload.model.experts`); the cache that serves them is planned in
`offload.pure.experts`.
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
    """

    INDICES = "indices"
    SCORES = "scores"


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
            are contiguous (stride[0] equal to the row's element count).
        expert_bytes: B, the bytes of one expert over all of `params` (each tensor's
            bytes divided by E).
        routing: how the module is told which experts run.
    """

    layer: int = attrs.field(validator=int_at_least(0, PlanError))
    module: str = attrs.field(validator=non_empty_str(PlanError))
    num_experts: int = attrs.field(validator=int_at_least(2, PlanError))
    params: tuple[str, ...] = attrs.field(validator=_names)
    expert_bytes: int = attrs.field(validator=int_at_least(1, PlanError))
    routing: Routing = attrs.field(validator=attrs.validators.instance_of(Routing))

    @property
    def nbytes(self) -> int:
        """Bytes of all its experts: E x B."""
        return self.num_experts * self.expert_bytes


def check_groups(groups: tuple[ExpertGroup, ...], layers: tuple[Any, ...]) -> None:
    """Raise `PlanError` unless every group matches the layers it names (`LayerSpec`s):
    its layer exists, each of its parameters is in that layer with leading dimension E and
    contiguous rows, B is their bytes over E, and no layer holds one module twice.

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
