"""Describe live modules as a `ModelSpec`: names, shapes, strides, dtypes, shared storage.

Only tensor metadata is read (sizes, strides, dtype, device, storage pointer and offset);
no weight is copied, moved or made contiguous, so describing a model on the GPU costs no
device memory and describing one on the meta device works the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from offload.errors import PlanError
from offload.pure.spec import LayerSpec, ModelSpec, ParamSpec

__all__ = ["describe_layers", "describe_tensor", "dtype_name", "storage_key"]


def storage_key(tensor: torch.Tensor) -> str | None:
    """An identity for a tensor view, equal exactly for views that are the same tensor.

    Two tensors get the same key when they share the untyped storage (same device and
    data pointer) and have the same storage offset, shape, stride and dtype, which is
    what tied parameters are. Overlapping but different views (a weight and its
    transpose, two slices of one buffer) get different keys.

    Args:
        tensor: any tensor; it is not read, only its metadata.

    Meta tensors have no memory, so their storage is told apart by the identity of its
    storage object (``_cdata``, the address of PyTorch's StorageImpl), which tied meta
    parameters share: a plan made from a meta model before loading knows its ties. Such a
    key means something only while the tensors described are alive, which is all a
    `ModelSpec` needs.

    Returns:
        The key, or None when identity cannot be told: tensors without storage (data
        pointer 0, e.g. empty ones) and tensors whose storage cannot be accessed (sparse
        and some subclasses).
    """
    try:
        storage = tensor.untyped_storage()
        if tensor.device.type == "meta":
            where = f"meta@storage{int(storage._cdata):#x}"
        elif (pointer := storage.data_ptr()) != 0:
            where = f"{tensor.device}@{pointer:#x}"
        else:
            return None
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    shape = "x".join(str(size) for size in tensor.shape)
    stride = ",".join(str(step) for step in tensor.stride())
    return f"{where}+{tensor.storage_offset()}:{shape}/{stride}:{dtype_name(tensor.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def describe_tensor(layer_index: int, name: str, tensor: torch.Tensor) -> ParamSpec:
    """The `ParamSpec` of one parameter's tensor, from its metadata only.

    Raises:
        PlanError: the tensor is not dense (strided).
    """
    if tensor.layout != torch.strided:
        raise PlanError(
            f"layer {layer_index}: parameter {name!r} has layout {tensor.layout}; "
            "only strided (dense) tensors can be offloaded",
            name=name,
            value=str(tensor.layout),
        )
    return ParamSpec(
        name=name,
        shape=tuple(int(size) for size in tensor.shape),
        stride=tuple(int(step) for step in tensor.stride()),
        dtype=dtype_name(tensor.dtype),
        itemsize=tensor.element_size(),
        storage_key=storage_key(tensor),
        device=str(tensor.device),
    )


def describe_layers(layers: Iterable[nn.Module]) -> ModelSpec:
    """Describe the layers of a model, in execution order, without touching their data.

    Args:
        layers: the model's repeated blocks (a list, tuple or ``nn.ModuleList``); each
            one is offloaded and prefetched as a unit.

    Returns:
        One `LayerSpec` per layer: ``index`` its position, ``name`` its class name, and
        ``params`` in ``named_parameters(remove_duplicate=False)`` order with names
        relative to the layer, so a parameter tied within the layer is listed under each
        of its names (with equal ``storage_key``). Sizes are in elements, ``nbytes`` in
        bytes.

    Raises:
        PlanError: `layers` is not iterable (e.g. a single layer), an
            element is not an ``nn.Module``, or a parameter is not a dense tensor.
    """
    # Checked at run time too: callers without a type checker pass a single module.
    given: object = layers
    if not isinstance(given, Iterable):
        raise PlanError(
            f"describe_layers takes a sequence of layers, got a {type(given).__name__}; "
            "pass e.g. model.layers",
            name="layers",
            value=given,
        )
    specs: list[LayerSpec] = []
    for index, item in enumerate(given):
        layer: object = item
        if not isinstance(layer, nn.Module):
            raise PlanError(
                f"layers[{index}] is a {type(layer).__name__}, not a torch.nn.Module",
                name=f"layers[{index}]",
                value=layer,
            )
        params = tuple(
            describe_tensor(index, name, param)
            for name, param in layer.named_parameters(remove_duplicate=False)
        )
        specs.append(LayerSpec(index=index, name=type(layer).__name__, params=params))
    return ModelSpec(layers=tuple(specs))
