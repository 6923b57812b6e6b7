"""What a model's layers hold: parameter names, shapes, strides, dtypes and bytes.

A `ModelSpec` is built by the shell from live modules (`offload.describe_layers`) or from
checkpoint headers (`offload.model.checkpoint`), or by hand; it never holds a tensor.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, is_int, is_str, non_empty_str, tuple_of, tuple_of_ints
from offload.pure._slots import slot_setters
from offload.pure.spec.experts import ExpertGroup, check_groups

__all__ = [
    "COMPUTE_DEVICE",
    "DTYPE_ITEMSIZE",
    "LayerSpec",
    "ModelSpec",
    "ParamSpec",
    "contiguous_stride",
    "param_sizes",
    "runs",
    "trusted_layer_spec",
    "trusted_model_spec",
    "trusted_param_spec",
]

#: The device of a parameter that is not loaded yet and will be loaded onto the compute
#: device (presets and checkpoints). It is eligible for offloading on every platform.
COMPUTE_DEVICE = "compute"

#: Bytes per element of the torch dtypes we know, by name without the ``torch.`` prefix.
#: Sized by element size, never by ``finfo`` (which integer and float8 dtypes lack or
#: misreport). A dtype missing here is accepted with the itemsize the caller gives.
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major (C-contiguous) strides, in elements, of `shape`."""
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def param_sizes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """(numel, nbytes) of a parameter: its elements, and the bytes they span in storage
    (see `ParamSpec.nbytes`); `shape` and `stride` have equal lengths."""
    numel = math.prod(shape)
    if numel == 0:
        return 0, 0
    # The offset of the last element, sum((size - 1) * step), summed in C.
    last = sum(map(operator.mul, shape, stride)) - sum(stride)
    return numel, (last + 1) * itemsize


@attrs.frozen(kw_only=True)
class ParamSpec:
    """One parameter of a layer, without its data.

    Attributes:
        name: the dotted name relative to its layer, as ``named_parameters()`` gives it
            (``mlp.up.weight``).
        shape: sizes, in elements.
        stride: strides, in elements; equal to `contiguous_stride(shape)` unless the
            tensor is a non-contiguous view (e.g. transposed).
        dtype: the torch dtype's name without ``torch.`` (``bfloat16``, ``float8_e4m3fn``).
        itemsize: bytes per element.
        storage_key: parameters with the same non-None key are the same tensor (tied) and
            are stored once; None means not shared.
        device: where the data lives now (``cuda:0``, ``cpu``, ``meta``), or
            `COMPUTE_DEVICE` for weights that will be loaded onto the compute device.
    """

    name: str = attrs.field(validator=non_empty_str(PlanError))
    shape: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    stride: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    dtype: str = attrs.field(validator=non_empty_str(PlanError))
    itemsize: int = attrs.field(validator=int_at_least(1, PlanError))
    storage_key: str | None = attrs.field(default=None, validator=non_empty_str(PlanError, optional=True))
    device: str = attrs.field(default=COMPUTE_DEVICE, validator=is_str(PlanError))

    def __attrs_post_init__(self) -> None:
        if len(self.shape) != len(self.stride):
            raise PlanError(
                f"parameter {self.name!r}: shape {self.shape} and stride {self.stride} "
                "have different lengths",
                name=self.name,
                value=(self.shape, self.stride),
            )
        known = DTYPE_ITEMSIZE.get(self.dtype)
        if known is not None and known != self.itemsize:
            raise PlanError(
                f"parameter {self.name!r}: dtype {self.dtype} has itemsize {known}, "
                f"got {self.itemsize}",
                name=self.name,
                value=self.itemsize,
            )
        # Filled now rather than on first read: a first read goes through attrs' slotted
        # __getattr__, which costs more than computing them, and plans read them all.
        numel, nbytes = param_sizes(self.shape, self.stride, self.itemsize)
        _SET_BUFFER_KEY(self, (self.name, self.shape, self.stride, self.dtype))
        _SET_NUMEL(self, numel)
        _SET_NBYTES(self, nbytes)

    # Cached properties, so that attrs gives them slots; both constructors fill them, and
    # the properties compute them only for an instance that was not built by either
    # (unpickled or copied: those restore the fields alone).

    @functools.cached_property
    def buffer_key(self) -> tuple[str, tuple[int, ...], tuple[int, ...], str]:
        """(name, shape, stride, dtype): parameters with equal keys can share a static buffer."""
        return (self.name, self.shape, self.stride, self.dtype)

    @functools.cached_property
    def numel(self) -> int:
        """Number of elements."""
        return param_sizes(self.shape, self.stride, self.itemsize)[0]

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes spanned by the elements in storage, for any strides.

        For a contiguous tensor this is ``numel * itemsize``; for a transposed or sliced
        view it is the extent from the first to the last element, which is what a
        stride-preserving host copy occupies. Zero for an empty tensor.
        """
        return param_sizes(self.shape, self.stride, self.itemsize)[1]


# The trusted builders below create instances without their __init__ (see _slots).
_NEW = object.__new__

(
    _SET_NAME, _SET_SHAPE, _SET_STRIDE, _SET_DTYPE, _SET_ITEMSIZE, _SET_STORAGE_KEY, _SET_DEVICE,
    _SET_BUFFER_KEY, _SET_NUMEL, _SET_NBYTES,
) = slot_setters(
    ParamSpec,
    ("name", "shape", "stride", "dtype", "itemsize", "storage_key", "device"),
    derived=("buffer_key", "numel", "nbytes"),
)


def trusted_param_spec(
    name: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: str,
    itemsize: int,
    storage_key: str | None,
    device: str,
    numel: int,
    nbytes: int,
) -> ParamSpec:
    """A `ParamSpec` equal to ``ParamSpec(name=name, ...)``, built without checking it.

    For the shell describing live tensors, whose metadata holds every rule of the class by
    construction (torch refuses empty names, negative sizes and strides; a dtype's name
    and element size agree): describing a large model checks nothing twice. Values from
    users go through the class, which checks them.

    Args:
        name, shape, stride, dtype, itemsize, storage_key, device: the fields, already
            valid (see `ParamSpec`): plain ``str``, ``int`` and tuples of ``int``.
        numel, nbytes: ``param_sizes(shape, stride, itemsize)``.
    """
    p = _NEW(ParamSpec)
    _SET_NAME(p, name)
    _SET_SHAPE(p, shape)
    _SET_STRIDE(p, stride)
    _SET_DTYPE(p, dtype)
    _SET_ITEMSIZE(p, itemsize)
    _SET_STORAGE_KEY(p, storage_key)
    _SET_DEVICE(p, device)
    _SET_BUFFER_KEY(p, (name, shape, stride, dtype))
    _SET_NUMEL(p, numel)
    _SET_NBYTES(p, nbytes)
    return p


@attrs.frozen(kw_only=True)
class LayerSpec:
    """One layer: the unit that is offloaded and prefetched as a whole.

    Attributes:
        index: the layer's position in the model, counted from 0.
        name: a label for people (``model.layers.3`` or the module's class name).
        params: the layer's parameters in ``named_parameters()`` order; names are unique.
    """

    index: int = attrs.field(validator=int_at_least(0, PlanError))
    name: str = attrs.field(validator=is_str(PlanError))
    params: tuple[ParamSpec, ...] = attrs.field(validator=tuple_of(ParamSpec, PlanError))

    def __attrs_post_init__(self) -> None:
        seen: set[str] = set()
        for param in self.params:
            if param.name in seen:
                raise PlanError(
                    f"layer {self.index} ({self.name}) has two parameters named {param.name!r}",
                    name=param.name,
                    value=self.index,
                )
            seen.add(param.name)

    @property
    def nbytes(self) -> int:
        """Bytes of all parameters, tied ones counted once per distinct storage key."""
        return _unique_bytes(self.params)


_SET_LAYER_INDEX, _SET_LAYER_NAME, _SET_LAYER_PARAMS = slot_setters(LayerSpec, ("index", "name", "params"))


def trusted_layer_spec(index: int, name: str, params: tuple[ParamSpec, ...]) -> LayerSpec:
    """A `LayerSpec` equal to ``LayerSpec(index=index, name=name, params=params)``, built
    without checking it: for the shell, whose `params` come from one module's
    ``named_parameters()`` (names unique by construction). See `trusted_param_spec`."""
    layer = _NEW(LayerSpec)
    _SET_LAYER_INDEX(layer, index)
    _SET_LAYER_NAME(layer, name)
    _SET_LAYER_PARAMS(layer, params)
    return layer


def _layers(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    tuple_of(LayerSpec, PlanError)(instance, attribute, value)
    for position, layer in enumerate(value):
        if layer.index != position:
            raise PlanError(
                f"layer at position {position} has index {layer.index}; indices must run 0, 1, 2, ...",
                name="index",
                value=layer.index,
            )


def _unique_bytes(params: tuple[ParamSpec, ...]) -> int:
    seen: set[str] = set()
    total = 0
    for param in params:
        if param.storage_key is not None:
            if param.storage_key in seen:
                continue
            seen.add(param.storage_key)
        total += param.nbytes
    return total


def runs(sizes: tuple[int, ...], total: int) -> tuple[tuple[int, int], ...]:
    """Consecutive runs of `sizes` items as ``(first, stop)`` each; one run of all `total`
    items when `sizes` is empty (none when `total` is 0): `ModelSpec.stack_ranges`,
    `PrefetchSchedule.cycle_ranges`."""
    out: list[tuple[int, int]] = []
    first = 0
    for size in sizes or ((total,) if total else ()):
        out.append((first, first + size))
        first += size
    return tuple(out)


def _stacks(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(is_int(v) and v >= 1 for v in value):
        raise PlanError(f"stacks must be a tuple of layer counts of 1 or more, got {value!r}",
                        name="stacks", value=value)
    if value and sum(value) != len(instance.layers):
        raise PlanError(f"stacks {value} hold {sum(value)} layers, the model has {len(instance.layers)}",
                        name="stacks", value=value)


@attrs.frozen(kw_only=True)
class ModelSpec:
    """The layers of a model, in execution order.

    Attributes:
        layers: one `LayerSpec` per layer; ``layers[i].index == i``.
        stacks: layers per stack, when the model has several layer stacks that run
            apart (an encoder and a decoder, a vision tower and a language model): the
            stacks' layers lie one after the other in `layers`, in this order, and each
            stack is scheduled as a cycle of its own (`offload.pure.plan.schedule`).
            Empty: one stack of every layer.
        experts: the experts modules of its mixture-of-experts layers, found by shape
            (`offload.model.experts`): each as E experts of B bytes, among its layer's
            parameters; the layer's other parameters are its non-expert part. Empty: no
            MoE layer (or none found).
    """

    layers: tuple[LayerSpec, ...] = attrs.field(validator=_layers)
    stacks: tuple[int, ...] = attrs.field(default=(), validator=_stacks)
    experts: tuple[ExpertGroup, ...] = attrs.field(default=(), validator=tuple_of(ExpertGroup, PlanError))

    def __attrs_post_init__(self) -> None:
        check_groups(self.experts, self.layers)

    @property
    def stack_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each stack's layers as ``(first, stop)``; one stack of every layer when `stacks`
        is empty (none for a model without layers)."""
        return runs(self.stacks, len(self.layers))

    @property
    def num_params(self) -> int:
        """Number of parameters over all layers (tied names counted separately)."""
        return sum(len(layer.params) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of all parameters, each distinct storage counted once."""
        return _unique_bytes(tuple(p for layer in self.layers for p in layer.params))


_SET_LAYERS, _SET_STACKS, _SET_EXPERTS = slot_setters(ModelSpec, ("layers", "stacks", "experts"))


def trusted_model_spec(layers: tuple[LayerSpec, ...], stacks: tuple[int, ...] = (),
                       experts: tuple[ExpertGroup, ...] = ()) -> ModelSpec:
    """A `ModelSpec` equal to ``ModelSpec(layers=layers, stacks=stacks, experts=experts)``,
    built without checking it: for the shell, which numbers `layers` 0, 1, 2, ... itself,
    counts the stacks from the layers it was given and finds the experts groups among the
    parameters it described. See `trusted_param_spec`."""
    model = _NEW(ModelSpec)
    _SET_LAYERS(model, layers)
    _SET_STACKS(model, stacks)
    _SET_EXPERTS(model, experts)
    return model
