"""The layer stacks of a checkpoint, from its tensors (each a `TensorHeader`, parsed by
`offload.pure.spec.safetensors`).

Layers are found by structure, not by a table of names. A tensor's first dotted segment
that is a decimal integer, with a prefix before it and a name after it, places it:
``model.layers.12.mlp.up_proj.weight`` is parameter ``mlp.up_proj.weight`` of layer
``model.layers.12`` of the stack ``model.layers``; ``encoder.block.3.layer.0.w`` is in
layer 3 of ``encoder.block``, and ``model.layers.3.mlp.experts.7.w1.weight`` stays in
layer 3 (the first integer wins). A prefix is a stack when its numbers run 0, 1, ...,
n - 1, with two rules against false positives:

- a prefix whose numbers have a gap is an error naming the missing layer, unless every
  entry holds only direct tensors (``merger.mlp.0.weight``, ``merger.mlp.2.weight``: an
  ``nn.Sequential`` of single modules with a parameterless activation between them), in
  which case its tensors are not layers;
- a prefix with a single entry (``mid_block.attentions.0``) is a stack only when no
  prefix has two or more.

Tensors outside every layer (embeddings, the final norm, the output head) are returned
apart: they are not offloaded, and stay on the device.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import attrs

from offload.errors import CheckpointError
from offload.pure._checks import int_at_least, non_empty_str, tuple_of
from offload.pure.spec.safetensors import TensorHeader, fail, printable, short_repr
from offload.pure.spec.values import COMPUTE_DEVICE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = ["CheckpointSpec", "StackSpec", "match_stack_order", "spec_from_tensors"]

_INDEX = re.compile(r"[0-9]+")


def _model_spec(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, ModelSpec):
        raise CheckpointError(f"{attribute.name} must be a ModelSpec, got {short_repr(value)}",
                              name=attribute.name, value=value)


@attrs.frozen(kw_only=True)
class StackSpec:
    """One stack of layers in a checkpoint: a dotted prefix numbered 0..n-1.

    Attributes:
        name: the prefix (``model.layers``, ``encoder.block``); its layers are named
            ``<name>.0`` to ``<name>.<n-1>``.
        first_layer: the `LayerSpec.index` of its layer 0 in the checkpoint's `ModelSpec`
            (stacks are concatenated there, in order).
        num_layers: n, layers (>= 1).
        nbytes: bytes of every tensor in its layers.
    """

    name: str = attrs.field(validator=non_empty_str(CheckpointError))
    first_layer: int = attrs.field(validator=int_at_least(0, CheckpointError))
    num_layers: int = attrs.field(validator=int_at_least(1, CheckpointError))
    nbytes: int = attrs.field(validator=int_at_least(0, CheckpointError))


@attrs.frozen(kw_only=True)
class CheckpointSpec:
    """What a checkpoint's headers say: the layers to plan with, and what lies outside them.

    Attributes:
        spec: the layers, in the order `spec_from_tensors` documents.
        outside_layers: tensors in no layer (embeddings, final norm, output head), sorted by
            name; they are not part of `spec` and are never offloaded.
        stacks: the stacks the layers come from, in `spec`'s order; together they cover
            every layer of `spec` exactly once.
        buffers: tensors the model holds as persistent buffers, not parameters (named by
            the caller, who knows the model class: `spec_from_tensors`), sorted by name;
            like the model's other buffers they stay on the device and are not in `spec`.

    Raises:
        CheckpointError: a field of the wrong type, or `stacks` that do not tile `spec`'s
            layers by name and bytes.
    """

    spec: ModelSpec = attrs.field(validator=_model_spec)
    outside_layers: tuple[TensorHeader, ...] = attrs.field(validator=tuple_of(TensorHeader, CheckpointError))
    stacks: tuple[StackSpec, ...] = attrs.field(validator=tuple_of(StackSpec, CheckpointError))
    buffers: tuple[TensorHeader, ...] = attrs.field(default=(), validator=tuple_of(TensorHeader, CheckpointError))

    def __attrs_post_init__(self) -> None:
        layers = self.spec.layers
        expected = [(f"{stack.name}.{i}", stack.first_layer + i) for stack in self.stacks
                    for i in range(stack.num_layers)]
        tiled = expected == [(layer.name, layer.index) for layer in layers] and all(
            stack.nbytes == sum(layer.nbytes for layer in layers[stack.first_layer:stack.first_layer + stack.num_layers])
            for stack in self.stacks
        )
        if not tiled:
            raise CheckpointError(
                f"stacks do not describe the layers: {short_repr([(s.name, s.first_layer, s.num_layers) for s in self.stacks])}"
                f" for {len(layers)} layers", name="stacks", value=self.stacks)

    @property
    def outside_bytes(self) -> int:
        """Bytes of every tensor not in `spec`, which stays on the device: the tensors
        outside every layer and the buffers."""
        return sum(tensor.nbytes for tensor in self.outside_layers) + self.buffer_bytes

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers."""
        return sum(tensor.nbytes for tensor in self.buffers)


def _layer_of(name: str) -> tuple[str, str, str] | None:
    """Split a tensor name at its first integer segment: (stack, index text, param name),
    or None when that segment is first or last, or there is none."""
    segments = name.split(".")
    position = next((i for i, segment in enumerate(segments) if _INDEX.fullmatch(segment)), None)
    if position is None or position == 0 or position == len(segments) - 1:
        return None
    param = ".".join(segments[position + 1:])
    return (".".join(segments[:position]), segments[position], param) if param else None


def _param(tensor: TensorHeader, name: str) -> ParamSpec:
    return ParamSpec(name=name, shape=tensor.shape, stride=contiguous_stride(tensor.shape),
                     dtype=tensor.dtype, itemsize=tensor.itemsize, storage_key=None, device=COMPUTE_DEVICE)


_Entries = dict[int, list[tuple[str, TensorHeader]]]


def _first_missing(indices: Iterable[int]) -> int | None:
    """The least integer >= 0 missing from `indices`; None when they are exactly 0..n-1."""
    ordered = sorted(indices)
    return next((expected for expected, index in enumerate(ordered) if index != expected), None)


def spec_from_tensors(tensors: Iterable[TensorHeader], *, buffers: Collection[str] = frozenset(),
                      running: Sequence[tuple[str, int]] = ()) -> CheckpointSpec:
    """Group checkpoint tensors into stacks of layers, found by structure.

    The layer of a tensor is the prefix up to and including its first integer segment
    (``model.layers.12``, ``encoder.block.3``); its parameter name is the rest
    (``mlp.up_proj.weight``). Which prefixes are stacks is as the module docstring says:
    numbers 0..n-1; a gap is an error unless every entry holds only direct tensors (then
    they are not layers); a single-entry prefix is a stack only when no prefix has two or
    more entries. Stacks come in the order their first tensor appears when all names are
    sorted (``decoder.block`` before ``encoder.block``); within a stack, layers run by
    number (2 before 10). Parameters within a layer are sorted by name, on the compute
    device, contiguous, not tied.

    Args:
        tensors: every tensor of the checkpoint, all files together, in any order.
        buffers: names of tensors the model holds as persistent buffers (known from its
            class, e.g. built on meta: `offload.hf.checkpoint_buffers`): they are taken out
            before layers are found and returned apart; names the checkpoint lacks are
            ignored. Empty: every tensor in a layer is planned as a parameter.
        running: the model's own stacks as (module path, layers), in the order it runs
            them (`offload.hf.checkpoint_buffers` knows them): the checkpoint's stacks that
            match them (`match_stack_order`) come first, in that order, then the others as
            below.

    Returns:
        The `ModelSpec` (``LayerSpec.index`` 0..n-1 over all stacks, ``LayerSpec.name``
        the prefix; `ModelSpec.stacks` counting each stack's layers when there are several,
        each then prefetched as a cycle of its own), its stacks, the tensors outside every
        layer, and the buffers.

    Raises:
        CheckpointError: a tensor name appears twice; no tensor is in a layer (the message
            says what was looked for, and names prefixes left out for gaps); a stack's
            numbers do not run 0, 1, 2, ... (names the first missing layer); or two
            spellings name one layer (``layers.01`` and ``layers.1``).
    """
    ordered = sorted(tensors, key=lambda t: t.name)
    held = frozenset(buffers)
    found_buffers = tuple(t for t in ordered if t.name in held)
    if found_buffers:
        ordered = [t for t in ordered if t.name not in held]
    candidates: dict[str, _Entries] = {}
    prefixes: dict[tuple[str, int], str] = {}
    outside: list[TensorHeader] = []
    previous: str | None = None
    for tensor in ordered:
        if tensor.name == previous:
            fail(f"tensor {tensor.name!r} appears twice", name=tensor.name, value=tensor.name)
        previous = tensor.name
        found = _layer_of(tensor.name)
        if found is None:
            outside.append(tensor)
            continue
        stack, text, param = found
        index, prefix = int(text), f"{stack}.{text}"
        known = prefixes.setdefault((stack, index), prefix)
        if known != prefix:
            fail(f"{known!r} and {prefix!r} name the same layer", name=prefix, value=known)
        candidates.setdefault(stack, {}).setdefault(index, []).append((param, tensor))
    stacks: dict[str, _Entries] = {}
    gapped: list[str] = []
    for stack, by_index in candidates.items():
        missing = _first_missing(by_index)
        if missing is None:
            stacks[stack] = by_index
        elif all("." not in param for entries in by_index.values() for param, _ in entries):
            # An nn.Sequential of single modules, a parameterless one between: not layers.
            gapped.append(f"{stack!r} (no entry {missing})")
            outside.extend(tensor for entries in by_index.values() for _, tensor in entries)
        else:
            name = f"{stack}.{missing}"
            fail(f"layer {printable(name)} is missing: {printable(stack)} has layers up to {max(by_index)} "
                  f"but none numbered {missing}", name=name, value=missing)
    if any(len(by_index) >= 2 for by_index in stacks.values()):
        for stack in [stack for stack, by_index in stacks.items() if len(by_index) == 1]:
            outside.extend(tensor for entries in stacks.pop(stack).values() for _, tensor in entries)
    leading = list(match_stack_order([(name, len(by_index)) for name, by_index in stacks.items()], running))
    stacks = {name: stacks[name] for name in [*leading, *(n for n in stacks if n not in leading)]}
    if not stacks:
        sample = tuple(t.name for t in ordered[:3])
        fail(f"no layers found: no tensor name among {len(ordered)} has a <stack>.<N>.<name> form with the "
              "stack's numbers running 0, 1, ..."
              + (f" (e.g. {', '.join(sample)})" if sample else "")
              + (f"; numbered with gaps, so not layers: {', '.join(gapped)}" if gapped else ""),
              name="layers", value=sample)
    layers: list[LayerSpec] = []
    found_stacks: list[StackSpec] = []
    for stack, by_index in stacks.items():
        first = len(layers)
        for index in range(len(by_index)):
            params = tuple(_param(tensor, param) for param, tensor in sorted(by_index[index], key=lambda p: p[0]))
            layers.append(LayerSpec(index=len(layers), name=prefixes[(stack, index)], params=params))
        found_stacks.append(StackSpec(name=stack, first_layer=first, num_layers=len(by_index),
                                      nbytes=sum(layer.nbytes for layer in layers[first:])))
    outside.sort(key=lambda t: t.name)
    counts = tuple(stack.num_layers for stack in found_stacks)
    return CheckpointSpec(spec=ModelSpec(layers=tuple(layers), stacks=counts if len(counts) > 1 else ()),
                          outside_layers=tuple(outside), stacks=tuple(found_stacks), buffers=found_buffers)


def match_stack_order(found: Sequence[tuple[str, int]], running: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """The checkpoint's stacks (`found`: name and layers, as `spec_from_tensors` found them)
    in the order the model runs its own (`running`: module path and layers, in order).

    A checkpoint may name a stack otherwise than the model's modules do (transformers
    saves Llava's ``model.language_model.layers`` as ``language_model.model.layers``), so a
    stack matches a module stack of as many layers by, in turn: the same path; one path
    ending with the other; the same dotted segments in another order. Each is matched once;
    stacks left unmatched are left out (they follow the matched ones, in name order).
    """
    def segments(path: str) -> frozenset[str]:
        return frozenset(path.split("."))

    rules = (
        lambda a, b: a == b,
        lambda a, b: a.endswith("." + b) or b.endswith("." + a),
        lambda a, b: segments(a) == segments(b),
    )
    matched: dict[int, str] = {}  # index in running -> checkpoint name
    taken: set[str] = set()
    for rule in rules:
        for index, (path, layers) in enumerate(running):
            if index in matched:
                continue
            hits = [name for name, count in found if name not in taken and count == layers and rule(name, path)]
            if len(hits) == 1:
                matched[index] = hits[0]
                taken.add(hits[0])
    return tuple(matched[index] for index in sorted(matched))
