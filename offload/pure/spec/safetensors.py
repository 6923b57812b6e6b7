"""Safetensors headers and indexes: parse a header, parse an index, check one against the other.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON,
then the tensor data. The JSON maps each tensor name to ``{"dtype": "BF16", "shape":
[4096, 4096], "data_offsets": [begin, end]}`` (byte offsets into the data section) and may
hold a ``"__metadata__"`` object of strings. A sharded checkpoint also has an index
(``model.safetensors.index.json``) whose ``"weight_map"`` maps each tensor name to the
file holding it. This module only interprets bytes the shell has read
(`offload.model.checkpoint`); it never opens a file.

The layer stacks these tensors form are found by `offload.pure.spec.stacks`.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import attrs

from offload.errors import CheckpointError
from offload.pure._checks import int_at_least, is_int, non_empty_str, tuple_of_ints
from offload.pure.spec.values import DTYPE_ITEMSIZE

__all__ = [
    "SAFETENSORS_DTYPES",
    "SHARD_SUFFIX",
    "TensorHeader",
    "check_index",
    "parse_safetensors_header",
    "parse_safetensors_index",
    "printable",
    "short_repr",
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
_REPR_LIMIT = 80


def printable(text: str) -> str:
    """`text` as it is when it is printable, else its `repr` (a file name with a newline or
    a control character must not break a one-line message)."""
    return text if text.isprintable() else repr(text)


def short_repr(value: object) -> str:
    """`repr(value)` on one line, cut to a readable length for an error message."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _known_dtype(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in SAFETENSORS_DTYPES.values():
        raise CheckpointError(f"{attribute.name} must be a dtype name safetensors can hold, got {short_repr(value)}",
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


def fail(message: str, *, name: str, value: object) -> NoReturn:
    raise CheckpointError(message, name=name, value=value)


def _unique_keys(source: str, what: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json.loads` object hook that refuses a key given twice (JSON allows it; we do not)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                fail(f"{source}: {what} names {key!r} twice", name=key, value=key)
            result[key] = value
        return result

    return hook


def _reject_constant(source: str, what: str) -> Callable[[str], NoReturn]:
    """A `json.loads` hook that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def hook(constant: str) -> NoReturn:
        fail(f"{source}: {what} is not valid JSON: {constant} is not a JSON number", name=source, value=constant)

    return hook


def _load_json(header: bytes, source: str, what: str = "header") -> object:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as error:
        fail(f"{source}: {what} is not UTF-8 text (byte {error.start})", name=source, value=header[:_REPR_LIMIT])
    try:
        return json.loads(text, object_pairs_hook=_unique_keys(source, what),
                          parse_constant=_reject_constant(source, what))
    except CheckpointError:
        raise
    except json.JSONDecodeError as error:
        fail(f"{source}: {what} is not valid JSON: {error.msg} at byte {error.pos}",
              name=source, value=text[:_REPR_LIMIT])
    except (ValueError, RecursionError) as error:
        # Integers past Python's digit limit, or nesting deeper than the recursion limit.
        fail(f"{source}: {what} is not usable JSON: {type(error).__name__}", name=source, value=text[:_REPR_LIMIT])


def _parse_entry(name: str, entry: object, source: str, data_bytes: int | None) -> TensorHeader:
    where = f"{source}: tensor {name!r}"
    if name == "":
        fail(f"{source}: a tensor has an empty name", name=source, value=name)
    if not isinstance(entry, dict):
        fail(f"{where}: entry must be a JSON object, got {short_repr(entry)}", name=name, value=entry)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            fail(f"{where}: entry has no {key!r}", name=name, value=entry)
    code = entry["dtype"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        fail(f"{where}: unknown dtype {short_repr(code)} (known: {', '.join(sorted(SAFETENSORS_DTYPES))})",
              name=name, value=code)
    dtype = SAFETENSORS_DTYPES[code]
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(is_int(size) and size >= 0 for size in shape):
        fail(f"{where}: shape must be a list of integers >= 0, got {short_repr(shape)}", name=name, value=shape)
    offsets = entry["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(is_int(offset) and offset >= 0 for offset in offsets)):
        fail(f"{where}: data_offsets must be [begin, end] with integers >= 0, got {short_repr(offsets)}",
              name=name, value=offsets)
    begin, end = offsets
    needed = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
    if end < begin or end - begin != needed:
        fail(f"{where}: data_offsets {offsets} span {end - begin} bytes, but {code} {shape} needs {needed}",
              name=name, value=offsets)
    if data_bytes is not None and end > data_bytes:
        fail(f"{where}: data_offsets {offsets} end past the {data_bytes} bytes of data "
              "(truncated or corrupt file)", name=name, value=offsets)
    return TensorHeader(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_overlaps(tensors: Iterable[TensorHeader], source: str) -> None:
    previous: TensorHeader | None = None
    for tensor in sorted((t for t in tensors if t.nbytes > 0), key=lambda t: (t.begin, t.name)):
        if previous is not None and tensor.begin < previous.end:
            fail(f"{source}: tensors {previous.name!r} [{previous.begin}, {previous.end}) and "
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
        fail(f"{source}: header must be a JSON object, got {type(document).__name__}",
              name=source, value=short_repr(document))
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
        fail(f"{where} must be a file name string, got {short_repr(shard)}", name=tensor, value=shard)
    if "/" in shard or "\\" in shard or "\0" in shard or shard in ("", ".", ".."):
        fail(f"{where} = {shard!r} is not a file name in the index's directory "
              "(no directory separators, no '..')", name=tensor, value=shard)
    if not shard.endswith(SHARD_SUFFIX):
        fail(f"{where} = {shard!r} is not a {SHARD_SUFFIX} file", name=tensor, value=shard)
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
        fail(f"{source}: index must be a JSON object, got {type(document).__name__}",
              name=source, value=short_repr(document))
    weight_map = document.get(_WEIGHT_MAP)
    if not isinstance(weight_map, dict):
        fail(f"{source}: index has no {_WEIGHT_MAP!r} object (got {short_repr(weight_map)})",
              name=source, value=weight_map)
    if not weight_map:
        fail(f"{source}: index's {_WEIGHT_MAP!r} names no tensors", name=source, value=weight_map)
    if "" in weight_map:
        fail(f"{source}: index's {_WEIGHT_MAP!r} maps an empty tensor name", name=source, value="")
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
            fail(f"{source}: tensor {tensor!r} is mapped to {printable(str(wanted))}, which does not hold it",
                  name=tensor, value=wanted)
        if wanted is None:
            fail(f"{source}: tensor {tensor!r} is in {printable(actual)} but the index does not name it",
                  name=tensor, value=actual)
        fail(f"{source}: tensor {tensor!r} is mapped to {printable(wanted)} but is in {printable(actual)}",
              name=tensor, value=(wanted, actual))


