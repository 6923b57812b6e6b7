"""Experts modules found by shape, not by name (`find_experts`): in each layer, a module
whose own parameters all have a leading dimension E equal to its expert count, with
contiguous rows, and no parameters below it.

Its expert count is its ``num_experts`` attribute where it has one, else the shared
leading dimension when its forward takes the routing (``forward(hidden_states,
top_k_index, top_k_weights)``). How it is told which experts run (`Routing`) comes from
its forward's signature: three or more inputs, the second the routing indices
(transformers 5's fused experts, gpt-oss); one input, the tokens laid out per expert and
scaled by the router's scores (Llama 4).

Or a ``ModuleList`` of E (2 or more) expert modules of one class and the same parameters,
alike in shape and dtype, beside a router: a parameter of its parent, outside the list, of
shape [E, X] (``gate.weight``). Each expert is then served when it is called
(`Routing.CALLS`), which assumes that the parent reads an expert's weights only by calling
it, as the models of this kind do (Mixtral's and Qwen2-MoE's older code, custom MoEs).

Its top-k (`ExpertGroup.top_k`, the experts each token is routed to) is the ``top_k`` that
its parent (the MoE block) or a sibling of it (the router) holds, as transformers' MoE
blocks and routers do; none where they hold none, or disagree.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from torch import nn

from offload.logs import logger
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import LayerSpec, ParamSpec

__all__ = ["find_experts", "routing_of", "top_k_of"]

log = logger("offload.plan")


def routing_of(module: nn.Module) -> Routing | None:
    """How `module`'s forward is told which experts run, read from its class's signature
    (an offloaded module's own forward is the cache's, which takes anything); None when it
    takes neither form."""
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return None
    inputs = [p for p in signature.parameters.values()
              if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][1:]
    if len(inputs) >= 3:
        return Routing.INDICES
    if len(inputs) == 1:
        return Routing.SCORES
    return None


def top_k_of(parent: nn.Module, experts: nn.Module, count: int) -> int | None:
    """The ``top_k`` that `parent` (the module holding `experts`) or another child of it
    holds, an int from 1 to `count`, where every one of them that holds one agrees; else
    None."""
    found = set()
    for holder in (parent, *(child for child in parent.children() if child is not experts)):
        value = getattr(holder, "top_k", None)
        if isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
    if len(found) != 1:
        return None
    k = found.pop()
    return k if 1 <= k <= count else None


def _group(index: int, path: str, module: nn.Module, parent: nn.Module | None,
           specs: Mapping[str, ParamSpec]) -> ExpertGroup | None:
    own = list(module.named_parameters(recurse=False))
    if not own or any(True for child in module.children() for _ in child.parameters()):
        return None
    if any(p.dim() < 2 for _, p in own) or all(p.dim() < 3 for _, p in own):
        return None
    leading = {p.shape[0] for _, p in own}
    if len(leading) != 1:
        return None
    experts = leading.pop()
    count = getattr(module, "num_experts", None)
    routing = routing_of(module)
    if routing is None or experts < 2:
        return None
    if isinstance(count, int) and not isinstance(count, bool):
        if count != experts:
            return None
    elif routing is not Routing.INDICES:
        return None  # one input and no expert count: nothing says the rows are experts
    names = tuple(f"{path}.{name}" if path else name for name, _ in own)
    total = 0
    for name, (_, param) in zip(names, own, strict=True):
        spec = specs.get(name)
        row = param[0].numel()
        if spec is None or param.stride(0) != row or param.shape[0] > 1 and not param[0].is_contiguous():
            log.debug("layer %d: %s looks like experts, but %r is not %d contiguous rows; whole layer",
                      index, path, name, experts)
            return None
        total += spec.nbytes
    if total % experts:
        return None
    return ExpertGroup(layer=index, module=path, num_experts=experts, params=names, expert_bytes=total // experts,
                       routing=routing, top_k=top_k_of(parent, module, experts) if parent is not None else None)


def _alike(module: nn.Module) -> list[tuple[str, tuple[int, ...], object]]:
    return [(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()]


def _list_group(index: int, path: str, module: nn.Module, parent: nn.Module,
                specs: Mapping[str, ParamSpec]) -> ExpertGroup | None:
    """A ``ModuleList`` of experts (`Routing.CALLS`), or None."""
    experts = list(module.children())
    e = len(experts)
    if not isinstance(module, nn.ModuleList) or e < 2 or len({type(x) for x in experts}) != 1:
        return None
    first = _alike(experts[0])
    if not first or any(_alike(x) != first for x in experts[1:]):
        return None
    inside = {id(p) for p in module.parameters()}
    if not any(p.dim() == 2 and p.shape[0] == e and id(p) not in inside for p in parent.parameters()):
        return None  # no router beside it: a list of layers alike, not of experts
    names = tuple(f"{path}.{j}.{name}" for j in range(e) for name, _, _ in first)
    if any(name not in specs for name in names):
        return None  # described otherwise (a quantised weight as its inner tensors)
    total = sum(specs[name].nbytes for name in names)
    if total % e:
        return None
    return ExpertGroup(layer=index, module=path, num_experts=e, params=names, expert_bytes=total // e,
                       routing=Routing.CALLS, top_k=top_k_of(parent, module, e))


def find_experts(index: int, layer: nn.Module, spec: LayerSpec) -> tuple[ExpertGroup, ...]:
    """The experts modules of one layer, as `spec` (its `LayerSpec`) names their
    parameters; none where its parameters are not described by those names (a quantised
    weight described as its inner tensors).

    Args:
        index: the layer's index in the model.
        layer: the layer.
        spec: its description (`offload.describe_layers`).
    """
    specs = {p.name: p for p in spec.params}
    found: list[ExpertGroup] = []
    modules = dict(layer.named_modules())
    for path, module in modules.items():
        parent = modules.get(path.rpartition(".")[0]) if path else None
        if isinstance(module, nn.ModuleList):
            group = _list_group(index, path, module, parent, specs) if parent is not None else None
        else:
            group = _group(index, path, module, parent, specs)
        if group is not None:
            found.append(group)
    return tuple(found)
