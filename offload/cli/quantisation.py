"""The sizes a load-time quantisation gives a checkpoint's weights, for ``offload plan
--quantization`` (pure: tensor headers in, tensor headers out; nothing is imported or read).

``int8`` is torchao's int8 weight-only quantisation (``Int8WeightOnlyConfig()``, per row,
as ``TorchAoConfig`` applies it at load): each ``nn.Linear`` weight of shape (out, in)
becomes an ``Int8Tensor`` whose inner tensors (`offload.model.wrappers`) are the int8
values (out, in), a float32 scale (out, 1) and an int8 zero point (out, 1). Offloaded, they
are three parameters named ``<module>.parametrizations.weight.original0..2``, as
`describe_layers` names them on the quantised model; a plan made from these headers is the
plan of that model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from offload.pure.spec.safetensors import TensorHeader, short_repr
from offload.pure.spec.values import DTYPE_ITEMSIZE

__all__ = ["INT8", "QUANTIZATIONS", "int8_weight_only", "saved_quantization"]

#: The ``--quantization`` values: torchao int8 weight-only, or none (the weights as saved).
INT8 = "int8"
QUANTIZATIONS = (INT8, "none")

#: torchao's int8 weight-only layout of a Linear weight (out, in): each inner tensor's
#: dtype and shape, in ``__tensor_flatten__`` order (qdata, scale, zero_point).
_INT8_INNER = (("int8", "values"), ("float32", "rows"), ("int8", "rows"))

#: The one ``quantization_config`` that `saved_quantization` reads as `INT8`.
_INT8_TYPE = "Int8WeightOnlyConfig"


def int8_weight_only(tensors: Iterable[TensorHeader], linear_weights: Collection[str]) -> tuple[TensorHeader, ...]:
    """`tensors` with each of `linear_weights` as torchao's int8 weight-only quantisation
    holds it (the module docstring), the others as they are; byte ranges laid end to end.

    Args:
        tensors: a checkpoint's tensors (names as it holds them).
        linear_weights: the names of the ``nn.Linear`` weights the quantisation converts
            (``<module>.weight``, 2-D).
    """
    out: list[TensorHeader] = []
    begin = 0

    def add(name: str, dtype: str, shape: tuple[int, ...]) -> None:
        nonlocal begin
        end = begin + math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        out.append(TensorHeader(name=name, dtype=dtype, shape=shape, begin=begin, end=end))
        begin = end

    chosen = frozenset(linear_weights)
    for tensor in tensors:
        if tensor.name not in chosen or len(tensor.shape) != 2 or not tensor.name.endswith(".weight"):
            add(tensor.name, tensor.dtype, tensor.shape)
            continue
        module = tensor.name.removesuffix(".weight")
        rows = tensor.shape[0]
        for index, (dtype, kind) in enumerate(_INT8_INNER):
            add(f"{module}.parametrizations.weight.original{index}", dtype,
                tensor.shape if kind == "values" else (rows, 1))
    return tuple(out)


def saved_quantization(config: Mapping[str, Any]) -> tuple[str | None, str]:
    """What a ``config.json``'s ``quantization_config`` asks for: `INT8` for torchao's
    int8 weight-only (per row), None for another one (or none), and one phrase naming it.

    Returns:
        (`INT8` or None, a description: ``torchao Int8WeightOnlyConfig``, ``gptq``, or
        ``none`` when the config has no quantization_config).
    """
    found = config.get("quantization_config")
    if found is None:
        return None, "none"
    if not isinstance(found, Mapping):
        return None, f"a quantization_config of {short_repr(found)}"
    method = found.get("quant_method")
    name = method if isinstance(method, str) else short_repr(method)
    if method != "torchao":
        return None, name
    kind = found.get("quant_type")
    default = kind.get("default") if isinstance(kind, Mapping) else None
    if not isinstance(default, Mapping):
        return None, f"torchao {short_repr(kind)}"
    data = default.get("_data")
    data = data if isinstance(data, Mapping) else {}
    granularity = data.get("granularity")
    per_row = granularity is None or (isinstance(granularity, Mapping) and granularity.get("_type") == "PerRow")
    type_name = default.get("_type")
    described = f"torchao {type_name if isinstance(type_name, str) else short_repr(type_name)}"
    plain = (type_name == _INT8_TYPE and per_row and data.get("group_size") is None
             and not found.get("include_input_output_embeddings"))
    return (INT8 if plain else None), described
