"""Model shapes from safetensors headers: parse one header, group tensors into layers.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON,
then the tensor data. The JSON maps each tensor name to ``{"dtype": "BF16", "shape":
[4096, 4096], "data_offsets": [begin, end]}`` (byte offsets into the data section) and may
hold a ``"__metadata__"`` object of strings. A sharded checkpoint also has an index
(``model.safetensors.index.json``) whose ``"weight_map"`` maps each tensor name to the
file holding it. This module only interprets bytes the shell has read
(`offload.model.checkpoint`); it never opens a file.

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

import json
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import attrs

from offload.errors import CheckpointError
from offload.pure._checks import int_at_least, is_int, non_empty_str, tuple_of, tuple_of_ints
from offload.pure.spec.values import COMPUTE_DEVICE, DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = [
    "SAFETENSORS_DTYPES",
    "SHARD_SUFFIX",
    "CheckpointSpec",
    "StackSpec",
    "TensorHeader",
    "check_index",
    "parse_safetensors_header",
    "parse_safetensors_index",
    "printable",
    "spec_from_tensors",
]

#: Safetensors dtype codes and the torch dtype names (without ``torch.``) they load as.
#: Sub-byte codes (``F4``, ``F6_E2M3``, ``F6_E3M2``) are absent: their shapes count
#: elements smaller than a byte, which a `ParamSpec` cannot describe.
SAFETENSORS_DTYPES: Mapping[str, str] = types.MappingProxyType(
    {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E8M0": "float8_e8m0fnu",
        "C64": "complex64",
    }
)

_METADATA_KEY = "__metadata__"
_INDEX = re.compile(r"[0-9]+")
_REPR_LIMIT = 80


def printable(text: str) -> str:
    """`text` as it is when it is printable, else its `repr` (a file name with a newline or
    a control character must not break a one-line message)."""
    return text if text.isprintable() else repr(text)


def _short(value: object) -> str:
    """`repr(value)` on one line, cut to a readable length for an error message."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _known_dtype(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in SAFETENSORS_DTYPES.values():
        raise CheckpointError(f"{attribute.name} must be a dtype name safetensors can hold, got {_short(value)}",
                              name=attribute.name, value=value)


@attrs.frozen(kw_only=True)
class TensorHeader:
    """One tensor as a safetensors header describes it; no data.

    Attributes:
        name: the full dotted name in the checkpoint (``model.layers.0.mlp.up_proj.weight``).
        dtype: the torch dtype's name without ``torch.`` (``bfloat16``, ``float8_e4m3fn``).
        shape: sizes, in elements.
        begin: first byte of the data, counted from the start of the file's data section.
        end: one past the last byte of the data, same origin; ``end - begin`` equals
            ``numel * itemsize``.
    """

    name: str = attrs.field(validator=non_empty_str(CheckpointError))
    dtype: str = attrs.field(validator=_known_dtype)
    shape: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, CheckpointError))
    begin: int = attrs.field(validator=int_at_least(0, CheckpointError))
    end: int = attrs.field(validator=int_at_least(0, CheckpointError))

    def __attrs_post_init__(self) -> None:
        if self.end - self.begin != self.numel * self.itemsize:
            raise CheckpointError(
                f"tensor {self.name!r}: byte range [{self.begin}, {self.end}) holds {self.end - self.begin} "
                f"bytes, but {self.dtype} {list(self.shape)} needs {self.numel * self.itemsize}",
                name=self.name,
                value=(self.begin, self.end),
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of data, ``end - begin``."""
        return self.end - self.begin


def _model_spec(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, ModelSpec):
        raise CheckpointError(f"{attribute.name} must be a ModelSpec, got {_short(value)}",
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

    Raises:
        CheckpointError: a field of the wrong type, or `stacks` that do not tile `spec`'s
            layers by name and bytes.
    """

    spec: ModelSpec = attrs.field(validator=_model_spec)
    outside_layers: tuple[TensorHeader, ...] = attrs.field(validator=tuple_of(TensorHeader, CheckpointError))
    stacks: tuple[StackSpec, ...] = attrs.field(validator=tuple_of(StackSpec, CheckpointError))

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
                f"stacks do not describe the layers: {_short([(s.name, s.first_layer, s.num_layers) for s in self.stacks])}"
                f" for {len(layers)} layers", name="stacks", value=self.stacks)

    @property
    def outside_bytes(self) -> int:
        """Bytes of the tensors outside every layer."""
        return sum(tensor.nbytes for tensor in self.outside_layers)


def _fail(message: str, *, name: str, value: object) -> NoReturn:
    raise CheckpointError(message, name=name, value=value)


def _unique_keys(source: str, what: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json.loads` object hook that refuses a key given twice (JSON allows it; we do not)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                _fail(f"{source}: {what} names {key!r} twice", name=key, value=key)
            result[key] = value
        return result

    return hook


def _reject_constant(source: str, what: str) -> Callable[[str], NoReturn]:
    """A `json.loads` hook that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def hook(constant: str) -> NoReturn:
        _fail(f"{source}: {what} is not valid JSON: {constant} is not a JSON number", name=source, value=constant)

    return hook


def _load_json(header: bytes, source: str, what: str = "header") -> object:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as error:
        _fail(f"{source}: {what} is not UTF-8 text (byte {error.start})", name=source, value=header[:_REPR_LIMIT])
    try:
        return json.loads(text, object_pairs_hook=_unique_keys(source, what),
                          parse_constant=_reject_constant(source, what))
    except CheckpointError:
        raise
    except json.JSONDecodeError as error:
        _fail(f"{source}: {what} is not valid JSON: {error.msg} at byte {error.pos}",
              name=source, value=text[:_REPR_LIMIT])
    except (ValueError, RecursionError) as error:
        # Integers past Python's digit limit, or nesting deeper than the recursion limit.
        _fail(f"{source}: {what} is not usable JSON: {type(error).__name__}", name=source, value=text[:_REPR_LIMIT])


def _parse_entry(name: str, entry: object, source: str, data_bytes: int | None) -> TensorHeader:
    where = f"{source}: tensor {name!r}"
    if name == "":
        _fail(f"{source}: a tensor has an empty name", name=source, value=name)
    if not isinstance(entry, dict):
        _fail(f"{where}: entry must be a JSON object, got {_short(entry)}", name=name, value=entry)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            _fail(f"{where}: entry has no {key!r}", name=name, value=entry)
    code = entry["dtype"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        _fail(f"{where}: unknown dtype {_short(code)} (known: {', '.join(sorted(SAFETENSORS_DTYPES))})",
              name=name, value=code)
    dtype = SAFETENSORS_DTYPES[code]
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(is_int(size) and size >= 0 for size in shape):
        _fail(f"{where}: shape must be a list of integers >= 0, got {_short(shape)}", name=name, value=shape)
    offsets = entry["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(is_int(offset) and offset >= 0 for offset in offsets)):
        _fail(f"{where}: data_offsets must be [begin, end] with integers >= 0, got {_short(offsets)}",
              name=name, value=offsets)
    begin, end = offsets
    needed = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if end < begin or end - begin != needed:
        _fail(f"{where}: data_offsets {offsets} span {end - begin} bytes, but {code} {shape} needs {needed}",
              name=name, value=offsets)
    if data_bytes is not None and end > data_bytes:
        _fail(f"{where}: data_offsets {offsets} end past the {data_bytes} bytes of data "
              "(truncated or corrupt file)", name=name, value=offsets)
    return TensorHeader(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_overlaps(tensors: Iterable[TensorHeader], source: str) -> None:
    previous: TensorHeader | None = None
    for tensor in sorted((t for t in tensors if t.nbytes > 0), key=lambda t: (t.begin, t.name)):
        if previous is not None and tensor.begin < previous.end:
            _fail(f"{source}: tensors {previous.name!r} [{previous.begin}, {previous.end}) and "
                  f"{tensor.name!r} [{tensor.begin}, {tensor.end}) overlap",
                  name=tensor.name, value=(tensor.begin, tensor.end))
        previous = tensor


def parse_safetensors_header(header: bytes, *, source: str, data_bytes: int | None) -> tuple[TensorHeader, ...]:
    """Parse and check the JSON header of one safetensors file.

    Args:
        header: the header bytes, i.e. the ``N`` bytes after the 8-byte length.
        source: what to call the file in error messages (its path).
        data_bytes: the size of the data section after the header, in bytes, to check the
            offsets against; None skips that check.

    Returns:
        One `TensorHeader` per tensor, sorted by name; ``__metadata__`` is skipped.

    Raises:
        CheckpointError: the header is not UTF-8 JSON, not an object, names a key twice,
            or an entry has an unknown dtype, a bad shape, offsets that are not
            ``[begin, end]`` spanning exactly ``numel * itemsize`` bytes, offsets past
            `data_bytes`, or a byte range overlapping another tensor's. The message is one
            line naming `source`, the tensor and the bad value.
    """
    document = _load_json(header, source)
    if not isinstance(document, dict):
        _fail(f"{source}: header must be a JSON object, got {type(document).__name__}",
              name=source, value=_short(document))
    tensors = tuple(
        _parse_entry(name, entry, source, data_bytes)
        for name, entry in sorted(document.items())
        if name != _METADATA_KEY
    )
    _check_overlaps(tensors, source)
    return tensors


#: The file suffix of a shard, and the index's key that maps tensors to shards.
SHARD_SUFFIX = ".safetensors"
_WEIGHT_MAP = "weight_map"


def _shard_name(tensor: str, shard: object, source: str) -> str:
    """Check one ``weight_map`` value: a bare ``.safetensors`` file name in the index's folder."""
    where = f"{source}: weight_map[{tensor!r}]"
    if not isinstance(shard, str):
        _fail(f"{where} must be a file name string, got {_short(shard)}", name=tensor, value=shard)
    if "/" in shard or "\\" in shard or "\0" in shard or shard in ("", ".", ".."):
        _fail(f"{where} = {shard!r} is not a file name in the index's directory "
              "(no directory separators, no '..')", name=tensor, value=shard)
    if not shard.endswith(SHARD_SUFFIX):
        _fail(f"{where} = {shard!r} is not a {SHARD_SUFFIX} file", name=tensor, value=shard)
    return shard


def parse_safetensors_index(raw: bytes, *, source: str) -> Mapping[str, str]:
    """Parse and check a sharded checkpoint's index (``model.safetensors.index.json``).

    Args:
        raw: the whole index file.
        source: what to call the index in error messages (its path).

    Returns:
        Its ``weight_map``: tensor name -> the shard's file name (no directory), as a
        read-only mapping sorted by tensor name. Other keys (``metadata``) are ignored.

    Raises:
        CheckpointError: the index is not UTF-8 JSON, not an object, names a key twice,
            has no ``weight_map`` object or an empty one, maps an empty tensor name, or
            maps a tensor to something other than a bare ``.safetensors`` file name (a
            non-string, a path with a directory separator, ``..``). One line, naming
            `source` and the tensor.
    """
    document = _load_json(raw, source, "index")
    if not isinstance(document, dict):
        _fail(f"{source}: index must be a JSON object, got {type(document).__name__}",
              name=source, value=_short(document))
    weight_map = document.get(_WEIGHT_MAP)
    if not isinstance(weight_map, dict):
        _fail(f"{source}: index has no {_WEIGHT_MAP!r} object (got {_short(weight_map)})",
              name=source, value=weight_map)
    if not weight_map:
        _fail(f"{source}: index's {_WEIGHT_MAP!r} names no tensors", name=source, value=weight_map)
    if "" in weight_map:
        _fail(f"{source}: index's {_WEIGHT_MAP!r} maps an empty tensor name", name=source, value="")
    return types.MappingProxyType({tensor: _shard_name(tensor, weight_map[tensor], source)
                                   for tensor in sorted(weight_map)})


def check_index(weight_map: Mapping[str, str], found: Mapping[str, str], *, source: str) -> None:
    """Check that the shards hold exactly the tensors the index maps to them.

    Args:
        weight_map: the index's tensor name -> shard file name (`parse_safetensors_index`).
        found: every tensor the shards hold -> the file name of the shard holding it.
        source: what to call the index in error messages.

    Raises:
        CheckpointError: the first tensor (by name) that the index maps to one shard but
            that is in another, that the index maps but no shard holds, or that a shard
            holds but the index does not name. Names the tensor and both files.
    """
    for tensor in sorted(weight_map.keys() | found.keys()):
        wanted, actual = weight_map.get(tensor), found.get(tensor)
        if wanted == actual:
            continue
        if actual is None:
            _fail(f"{source}: tensor {tensor!r} is mapped to {printable(str(wanted))}, which does not hold it",
                  name=tensor, value=wanted)
        if wanted is None:
            _fail(f"{source}: tensor {tensor!r} is in {printable(actual)} but the index does not name it",
                  name=tensor, value=actual)
        _fail(f"{source}: tensor {tensor!r} is mapped to {printable(wanted)} but is in {printable(actual)}",
              name=tensor, value=(wanted, actual))


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


def spec_from_tensors(tensors: Iterable[TensorHeader]) -> CheckpointSpec:
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

    Returns:
        The `ModelSpec` (``LayerSpec.index`` 0..n-1 over all stacks, ``LayerSpec.name``
        the prefix), its stacks, and the tensors outside every layer.

    Raises:
        CheckpointError: a tensor name appears twice; no tensor is in a layer (the message
            says what was looked for, and names prefixes left out for gaps); a stack's
            numbers do not run 0, 1, 2, ... (names the first missing layer); or two
            spellings name one layer (``layers.01`` and ``layers.1``).
    """
    ordered = sorted(tensors, key=lambda t: t.name)
    candidates: dict[str, _Entries] = {}
    prefixes: dict[tuple[str, int], str] = {}
    outside: list[TensorHeader] = []
    previous: str | None = None
    for tensor in ordered:
        if tensor.name == previous:
            _fail(f"tensor {tensor.name!r} appears twice", name=tensor.name, value=tensor.name)
        previous = tensor.name
        found = _layer_of(tensor.name)
        if found is None:
            outside.append(tensor)
            continue
        stack, text, param = found
        index, prefix = int(text), f"{stack}.{text}"
        known = prefixes.setdefault((stack, index), prefix)
        if known != prefix:
            _fail(f"{known!r} and {prefix!r} name the same layer", name=prefix, value=known)
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
            _fail(f"layer {printable(name)} is missing: {printable(stack)} has layers up to {max(by_index)} "
                  f"but none numbered {missing}", name=name, value=missing)
    if any(len(by_index) >= 2 for by_index in stacks.values()):
        for stack in [stack for stack, by_index in stacks.items() if len(by_index) == 1]:
            outside.extend(tensor for entries in stacks.pop(stack).values() for _, tensor in entries)
    if not stacks:
        sample = tuple(t.name for t in ordered[:3])
        _fail(f"no layers found: no tensor name among {len(ordered)} has a <stack>.<N>.<name> form with the "
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
    return CheckpointSpec(spec=ModelSpec(layers=tuple(layers)), outside_layers=tuple(outside),
                          stacks=tuple(found_stacks))
