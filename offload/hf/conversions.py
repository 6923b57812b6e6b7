"""Which checkpoint tensors make each tensor of a live model, and where each one's values go
in it: transformers' load-time conversions, read from transformers' own description.

transformers 5 converts some checkpoints as it loads them: it renames keys (Mixtral's
``block_sparse_moe.`` -> ``mlp.``) and fuses the experts, which checkpoints store one
tensor per expert (``mlp.experts.3.gate_proj.weight`` [I, H]), into tensors with a
leading expert dimension (``mlp.experts.gate_up_proj`` [E, 2I, H]). The model's class
lists them (``transformers.conversion_mapping.get_model_conversion_mapping``): each
`WeightRenaming` renames, each `WeightConverter` collects the stored tensors its source
patterns match and runs its operations on them. `live_sources` names the stored tensors
as transformers' own ``rename_source_key`` does (the key order ``dot_natural_key`` gives),
collects them as ``convert_and_load_state_dict_in_model`` does, and carries out the
operations on places instead of values: for each live tensor, the stored tensors and the
region of it (`Piece.index`) each one fills. Nothing is read.

Operations carried out: ``MergeModulelist`` (stack along a dimension) and ``Concatenate``
(along a dimension), which is what the Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and
OLMoE conversions run (gpt-oss and Llama 4 store their experts as the model holds them).
Any other operation (``Chunk``, ``Transpose``, a dequantisation ...) is refused with a
`CheckpointError` naming the weight and the operation: a streamed load never guesses.
A model that is not a transformers one (diffusers) is read by its names, as stored.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from offload.errors import CheckpointError
from offload.hf.offloader import outside_tensors
from offload.pure.spec.safetensors import TensorHeader

__all__ = ["LiveSource", "Outside", "Piece", "live_headers", "live_sources", "outside_sources", "source_of",
           "spill_runs"]

#: One entry per dimension of a live tensor: an index there (a dimension the stored
#: tensor does not have) or a range [start, stop).
Index = tuple[int | tuple[int, int], ...]


@attrs.frozen(kw_only=True)
class Piece:
    """One stored tensor and the region of a live tensor its values fill.

    Attributes:
        stored: its name in the checkpoint.
        index: where it goes (`Index`): the live tensor indexed so has its shape.
    """

    stored: str
    index: Index

    def view(self, live: torch.Tensor) -> torch.Tensor:
        """The region of `live` this piece fills (a view: writing it writes `live`)."""
        return live[tuple(i if isinstance(i, int) else slice(i[0], i[1]) for i in self.index)]


@attrs.frozen(kw_only=True)
class LiveSource:
    """Where one tensor of the live model comes from in the checkpoint.

    Attributes:
        name: its full name in the model (``model.layers.0.mlp.experts.gate_up_proj``).
        shape: the shape the checkpoint gives it (the live tensor must have it), in elements.
        pieces: the stored tensors that make it, each with its region; together they fill it.
        operations: transformers' operations that make it (``MergeModulelist(dim=0)``, ...);
            empty when it is one stored tensor as it is (under its name, or renamed).
    """

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    operations: tuple[str, ...] = ()

    @property
    def whole(self) -> str | None:
        """The stored tensor that is all of it as it is (renamed or not), or None."""
        if self.operations or len(self.pieces) != 1:
            return None
        return self.pieces[0].stored

    @property
    def as_stored(self) -> bool:
        """Whether it is the stored tensor of its own name, as it is."""
        return self.whole == self.name


def _whole(name: str, shape: tuple[int, ...], stored: str) -> LiveSource:
    return LiveSource(name=name, shape=shape, pieces=(Piece(stored=stored, index=tuple((0, n) for n in shape)),))


@attrs.frozen
class _Places:
    """A tensor of places (what an operation makes of stored tensors): its shape, and
    each stored tensor's region in it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def _refuse(weight: str, what: str, value: object) -> CheckpointError:
    return CheckpointError(f"{weight}: {what}: a streamed load cannot read it from the checkpoint; load without "
                           "host_budget_bytes", name=weight, value=value)


def _stack(parts: Sequence[_Places], dim: int, weight: str) -> _Places:
    """`torch.stack(parts, dim)` of places."""
    shape = parts[0].shape
    if any(p.shape != shape for p in parts):
        raise _refuse(weight, f"transformers stacks tensors of shapes {sorted({p.shape for p in parts})}", dim)
    at = dim if dim >= 0 else dim + len(shape) + 1
    pieces = tuple(Piece(stored=q.stored, index=(*q.index[:at], j, *q.index[at:]))
                   for j, p in enumerate(parts) for q in p.pieces)
    return _Places(shape=(*shape[:at], len(parts), *shape[at:]), pieces=pieces)


def _cat(parts: Sequence[_Places], dim: int, weight: str) -> _Places:
    """`torch.cat(parts, dim)` of places."""
    ndim = len(parts[0].shape)
    at = dim if dim >= 0 else dim + ndim
    rest = {p.shape[:at] + p.shape[at + 1:] for p in parts}
    if any(len(p.shape) != ndim for p in parts) or len(rest) != 1 or not 0 <= at < ndim:
        raise _refuse(weight, f"transformers concatenates tensors of shapes {[p.shape for p in parts]} along {dim}",
                      dim)
    pieces: list[Piece] = []
    offset = 0
    for p in parts:
        for q in p.pieces:
            here = q.index[at]
            moved = here + offset if isinstance(here, int) else (here[0] + offset, here[1] + offset)
            pieces.append(Piece(stored=q.stored, index=(*q.index[:at], moved, *q.index[at + 1:])))
        offset += p.shape[at]
    shape = parts[0].shape
    return _Places(shape=(*shape[:at], offset, *shape[at + 1:]), pieces=tuple(pieces))


def _run(converter: Any, collected: dict[str, list[_Places]], weight: str) -> dict[str, _Places]:
    """`converter`'s operations on places, each as transformers' runs it on tensors (the
    names it gives its results included), or refused."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    values: dict[str, Any] = dict(collected)
    for op in converter.operations:
        if type(op) is MergeModulelist:
            size = len(values)
            merged: dict[str, Any] = {}
            for pattern in list(values):
                found = values.pop(pattern)
                target = op.get_target_pattern(size, pattern, converter.target_patterns)
                merged[target] = found if isinstance(found, _Places) else _stack(found, op.dim, weight)
            values = merged
        elif type(op) is Concatenate:
            target = op.get_target_pattern(converter.target_patterns)
            parts: list[_Places] = []
            for pattern in converter.source_patterns:
                if pattern in values:
                    found = values.pop(pattern)
                    parts.extend(found if isinstance(found, list) else [found])
            values = {target: _cat(parts, op.dim, weight)}
        else:
            raise _refuse(weight, f"transformers makes it with the operation {op!r}, which a streamed load does not "
                          "carry out", repr(op))
    out: dict[str, _Places] = {}
    for key, found in values.items():
        if not isinstance(found, _Places):
            raise _refuse(weight, f"transformers' operations leave {len(found)} tensors for {key!r}", key)
        out[key] = found
    return out


def _is_transformers(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def live_sources(model: nn.Module, tensors: Mapping[str, TensorHeader]) -> dict[str, LiveSource]:
    """For each tensor of ``model.state_dict()`` that the checkpoint gives, where it comes
    from (see the module docstring); a tensor the checkpoint does not give (a tie's other
    name) is left out, and so is a stored tensor that gives none.

    Args:
        model: the model (its parameters may be on meta): its class's conversions, its names.
        tensors: the checkpoint's tensors, by name.

    Raises:
        CheckpointError: transformers would run an operation that is not carried out here,
            its operations do not fit the stored shapes, or two stored tensors are renamed to
            one; naming the weight.
    """
    live = model.state_dict(keep_vars=True)
    if not _is_transformers(model):
        return {name: _whole(name, tensors[name].shape, name) for name in live if name in tensors}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    pretrained: Any = model  # a PreTrainedModel (`_is_transformers`)
    mapping = get_model_conversion_mapping(pretrained)  # as from_pretrained asks (no key_mapping, no quantizer)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    present = dict.fromkeys(live, True)
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, list[str]] = {}
    collected: dict[str, tuple[Any, dict[str, list[_Places]]]] = {}
    for key in sorted(tensors, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if target not in present and key in present:  # as transformers: only the prefix, perhaps
            target, pattern = rename_source_key(key, [], [], prefix, present)
        if target not in present:
            continue  # transformers calls it unexpected and leaves it
        header = tensors[key]
        if pattern is None:
            renamed.setdefault(target, []).append(key)
            continue
        places = _Places(shape=header.shape, pieces=_whole(key, header.shape, key).pieces)
        converter, lists = collected.setdefault(target, (by_pattern[pattern], {}))
        lists.setdefault(pattern, []).append(places)
    found: dict[str, LiveSource] = {}
    for target, keys in renamed.items():
        if len(keys) > 1:
            raise _refuse(target, f"stored {len(keys)} times under the names transformers renames to it ({keys[0]!r}, "
                          f"{keys[1]!r})", keys)
        found[target] = _whole(target, tensors[keys[0]].shape, keys[0])
    for target, (converter, lists) in collected.items():
        full = target.replace("*.", "0.")
        results = _run(converter, lists, target)
        operations = tuple(repr(op) for op in converter.operations)
        # Named as WeightConverter.convert names its results: the target's prefix and suffix.
        split = next((full.partition(k) for k in results if k in full), None)
        for key, places in results.items():
            name = key if split is None else split[0] + key + split[2]
            if name in present and name not in found:
                found[name] = LiveSource(name=name, shape=places.shape, pieces=places.pieces, operations=operations)
    return found


def source_of(sources: Mapping[str, LiveSource], full: str) -> LiveSource:
    """Where the tensor named `full` in the model comes from.

    Raises:
        CheckpointError: the checkpoint does not give it, naming it.
    """
    found = sources.get(full)
    if found is None:
        raise CheckpointError(f"{full}: not in the checkpoint, under the model's name or any name transformers' "
                              "conversions give it: load without host_budget_bytes", name=full, value=None)
    return found


def spill_runs(source: LiveSource, itemsize: int) -> tuple[tuple[str, int], ...]:
    """Each stored tensor of `source` and the byte offset of its run in the live tensor
    laid out contiguously (what a spill file holds), for writing it piece by piece.

    Raises:
        CheckpointError: a piece whose region is not one contiguous run of the live tensor.
    """
    live = torch.empty(source.shape, dtype=torch.uint8, device="meta")
    runs: list[tuple[str, int]] = []
    for piece in source.pieces:
        region = piece.view(live)
        if not region.is_contiguous():
            raise _refuse(source.name, f"its stored tensor {piece.stored!r} is not one contiguous run of it, which a "
                          "disk-tier weight written piece by piece needs", piece.stored)
        runs.append((piece.stored, int(region.storage_offset()) * itemsize))
    return tuple(runs)


def live_headers(sources: Mapping[str, LiveSource], tensors: Mapping[str, TensorHeader]) -> tuple[TensorHeader, ...]:
    """The checkpoint's tensors (`tensors`) as the live model holds them (its `live_sources`):
    a stored one under its own name as it is, any other under its live name and shape, in
    the dtype of its first stored tensor, laid end to end (``begin``/``end`` are not file
    offsets); what gives no live tensor is left out. For planning the live layers."""
    found: list[TensorHeader] = []
    begin = 0
    for source in sources.values():
        if source.as_stored:
            found.append(tensors[source.name])
            continue
        dtype = tensors[source.pieces[0].stored].dtype
        header = TensorHeader(name=source.name, dtype=dtype, shape=source.shape, begin=begin,
                              end=begin + tensors[source.pieces[0].stored].itemsize * math.prod(source.shape))
        found.append(header)
        begin = header.end
    return tuple(found)


#: A tensor outside the layers to read: where it goes (each module and name holding it, a
#: tie's every name), where it comes from, the tensor there now, and whether it is a parameter.
Outside = tuple[list[tuple[nn.Module, str]], LiveSource, torch.Tensor, bool]


def outside_sources(model: nn.Module, layers: Sequence[nn.Module],
                    sources: Mapping[str, LiveSource]) -> list[Outside]:
    """Every parameter outside the layers (a tie once, under the first of its names the
    checkpoint gives) and every persistent buffer the checkpoint gives, checked against the
    shapes the checkpoint gives them; nothing is read.

    Raises:
        CheckpointError: a parameter under none of its names in the checkpoint (nor under
            any transformers' conversions give), or of another shape there.
    """
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}

    def full_name(module: nn.Module, name: str) -> str:
        return f"{names[id(module)]}.{name}".lstrip(".")

    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    found: list[Outside] = []
    for (module, name, is_param), tensor in outside_tensors(model, layers):
        full = full_name(module, name)
        if is_param and isinstance(tensor, nn.Parameter):
            slots.setdefault(id(tensor), []).append((module, name))
            params[id(tensor)] = tensor
        elif full in sources:  # a persistent buffer saved with the weights
            found.append(([(module, name)], sources[full], tensor, False))
    for key, param in params.items():
        where = slots[key]
        first = next((full_name(m, n) for m, n in where if full_name(m, n) in sources), None)
        if first is None:
            shown = ", ".join(full_name(m, n) for m, n in where)
            raise CheckpointError(f"{shown}: not in the checkpoint, under the model's name or any name transformers' "
                                  "conversions give it: load without host_budget_bytes", name=shown, value=None)
        found.append((where, sources[first], param, True))
    for _, source, tensor, _ in found:
        if source.shape != tuple(tensor.shape):
            raise CheckpointError(f"{source.name}: {source.shape} in the checkpoint, {tuple(tensor.shape)} in the "
                                  "model", name=source.name, value=source.shape)
    return found
