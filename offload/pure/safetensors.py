"""Model shapes from safetensors headers: parse one header, group tensors into layers.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON,
then the tensor data. The JSON maps each tensor name to ``{"dtype": "BF16", "shape":
[4096, 4096], "data_offsets": [begin, end]}`` (byte offsets into the data section) and may
hold a ``"__metadata__"`` object of strings. This module only interprets header bytes the
shell has read (`offload.checkpoint`); it never opens a file.

Layers are found by name: the first ``layers.N``, ``h.N`` or ``blocks.N`` pair of dotted
segments (``model.layers.12.mlp.up_proj.weight`` is parameter ``mlp.up_proj.weight`` of
layer ``model.layers.12``). Tensors outside every layer (embeddings, the final norm, the
output head) are returned apart: they are not offloaded.
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
from offload.pure.spec import COMPUTE_DEVICE, DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = [
    "LAYER_SEGMENTS",
    "SAFETENSORS_DTYPES",
    "CheckpointSpec",
    "TensorHeader",
    "parse_safetensors_header",
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

#: Segment names that, followed by a decimal index, mark a layer of a stack.
LAYER_SEGMENTS: frozenset[str] = frozenset({"layers", "h", "blocks"})

_METADATA_KEY = "__metadata__"
_INDEX = re.compile(r"[0-9]+")
_REPR_LIMIT = 80


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
class CheckpointSpec:
    """What a checkpoint's headers say: the layers to plan with, and what lies outside them.

    Attributes:
        spec: the layers, in the order `spec_from_tensors` documents.
        outside_layers: tensors in no layer (embeddings, final norm, output head), sorted by
            name; they are not part of `spec` and are never offloaded.
    """

    spec: ModelSpec = attrs.field(validator=_model_spec)
    outside_layers: tuple[TensorHeader, ...] = attrs.field(validator=tuple_of(TensorHeader, CheckpointError))

    @property
    def outside_bytes(self) -> int:
        """Bytes of the tensors outside every layer."""
        return sum(tensor.nbytes for tensor in self.outside_layers)


def _fail(message: str, *, name: str, value: object) -> NoReturn:
    raise CheckpointError(message, name=name, value=value)


def _unique_keys(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json.loads` object hook that refuses a key given twice (JSON allows it; we do not)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                _fail(f"{source}: header names {key!r} twice", name=key, value=key)
            result[key] = value
        return result

    return hook


def _reject_constant(source: str) -> Callable[[str], NoReturn]:
    """A `json.loads` hook that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def hook(constant: str) -> NoReturn:
        _fail(f"{source}: header is not valid JSON: {constant} is not a JSON number", name=source, value=constant)

    return hook


def _load_json(header: bytes, source: str) -> object:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as error:
        _fail(f"{source}: header is not UTF-8 text (byte {error.start})", name=source, value=header[:_REPR_LIMIT])
    try:
        return json.loads(text, object_pairs_hook=_unique_keys(source), parse_constant=_reject_constant(source))
    except CheckpointError:
        raise
    except json.JSONDecodeError as error:
        _fail(f"{source}: header is not valid JSON: {error.msg} at byte {error.pos}",
              name=source, value=text[:_REPR_LIMIT])
    except (ValueError, RecursionError) as error:
        # Integers past Python's digit limit, or nesting deeper than the recursion limit.
        _fail(f"{source}: header is not usable JSON: {type(error).__name__}", name=source, value=text[:_REPR_LIMIT])


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


def _layer_of(name: str) -> tuple[str, str, int, str] | None:
    """Split a tensor name at its first layer pair: (stack, layer prefix, index, param name)."""
    segments = name.split(".")
    for position in range(len(segments) - 2):
        if segments[position] in LAYER_SEGMENTS and _INDEX.fullmatch(segments[position + 1]):
            param = ".".join(segments[position + 2:])
            if param == "":
                return None
            stack = ".".join(segments[: position + 1])
            return stack, f"{stack}.{segments[position + 1]}", int(segments[position + 1]), param
    return None


def _param(tensor: TensorHeader, name: str) -> ParamSpec:
    return ParamSpec(name=name, shape=tensor.shape, stride=contiguous_stride(tensor.shape),
                     dtype=tensor.dtype, itemsize=tensor.itemsize, storage_key=None, device=COMPUTE_DEVICE)


def spec_from_tensors(tensors: Iterable[TensorHeader]) -> CheckpointSpec:
    """Group checkpoint tensors into layers by their ``layers.N`` / ``h.N`` / ``blocks.N`` names.

    The layer of a tensor is the prefix up to and including the first such pair
    (``model.layers.12``); its parameter name is the rest (``mlp.up_proj.weight``).
    Stacks (``model.layers``, ``vision.blocks``) come in the order their first tensor
    appears when all names are sorted; within a stack, layers run by ``N`` numerically
    (2 before 10). Parameters within a layer are sorted by name, on the compute device,
    contiguous, not tied.

    Args:
        tensors: every tensor of the checkpoint, all files together, in any order.

    Returns:
        The `ModelSpec` (``LayerSpec.index`` 0..n-1, ``LayerSpec.name`` the prefix) and
        the tensors outside every layer.

    Raises:
        CheckpointError: a tensor name appears twice; no tensor is in a layer; a stack's
            indices do not run 0, 1, 2, ... (names the first missing layer); or two
            spellings name one layer (``layers.01`` and ``layers.1``).
    """
    ordered = sorted(tensors, key=lambda t: t.name)
    stacks: dict[str, dict[int, list[tuple[str, TensorHeader]]]] = {}
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
        stack, prefix, index, param = found
        known = prefixes.setdefault((stack, index), prefix)
        if known != prefix:
            _fail(f"{known!r} and {prefix!r} name the same layer", name=prefix, value=known)
        stacks.setdefault(stack, {}).setdefault(index, []).append((param, tensor))
    if not stacks:
        sample = tuple(t.name for t in ordered[:3])
        _fail(f"no layers found: no tensor name among {len(ordered)} has a layers.N, h.N or blocks.N segment"
              + (f" (e.g. {', '.join(sample)})" if sample else ""), name="layers", value=sample)
    layers: list[LayerSpec] = []
    for stack, by_index in stacks.items():
        for expected, index in enumerate(sorted(by_index)):
            if index != expected:
                missing = f"{stack}.{expected}"
                _fail(f"layer {missing} is missing: {stack} has layers up to {max(by_index)} "
                      f"but none numbered {expected}", name=missing, value=expected)
            params = tuple(_param(tensor, param) for param, tensor in sorted(by_index[index], key=lambda p: p[0]))
            layers.append(LayerSpec(index=len(layers), name=prefixes[(stack, index)], params=params))
    return CheckpointSpec(spec=ModelSpec(layers=tuple(layers)), outside_layers=tuple(outside))
