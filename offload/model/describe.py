"""Describe live modules as a `ModelSpec`: names, shapes, strides, dtypes, shared storage.

Only tensor metadata is read (sizes, strides, dtype, device, storage pointer and offset);
no weight is copied, moved or made contiguous, so describing a model on the GPU costs no
device memory and describing one on the meta device works the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from offload.errors import PlanError
from offload.model.experts import find_experts
from offload.model.wrappers import expand_wrappers, inner_names, is_wrapper
from offload.pure.spec.experts import ExpertGroup
from offload.pure.spec.values import (
    LayerSpec,
    ModelSpec,
    ParamSpec,
    param_sizes,
    trusted_layer_spec,
    trusted_model_spec,
    trusted_param_spec,
)

__all__ = ["describe_layers", "describe_stacks", "describe_tensor", "dtype_name", "storage_key"]


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
    device = tensor.device
    where = _storage_where(tensor, str(device), device.type == "meta")
    if where is None:
        return None
    shape = tuple(int(size) for size in tensor.shape)
    stride = tuple(int(step) for step in tensor.stride())
    return f"{where}+{tensor.storage_offset()}{_key_suffix(shape, stride, dtype_name(tensor.dtype))}"


def _storage_where(tensor: torch.Tensor, device: str, is_meta: bool) -> str | None:
    """The storage part of `storage_key`: which storage, or None when it cannot be told."""
    try:
        storage = tensor.untyped_storage()
        if is_meta:
            return f"meta@storage{hex(storage._cdata)}"
        pointer = storage.data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return f"{device}@{hex(pointer)}" if pointer != 0 else None


def _key_suffix(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> str:
    """The view part of `storage_key`, after the storage offset."""
    return f":{'x'.join(map(str, shape))}/{','.join(map(str, stride))}:{dtype}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_STRIDED = torch.strided


#: What parameters with equal sizes, strides, dtype and device have in common: shape,
#: stride, dtype name, itemsize, device name, whether on the meta device, numel, nbytes,
#: and the end of their storage keys. A plain tuple: it is unpacked once per parameter.
_Metadata = tuple[tuple[int, ...], tuple[int, ...], str, int, str, bool, int, int, str]

#: `_Metadata` by (sizes, strides, dtype, device), for one `describe_layers` call: the
#: layers of a model repeat a few kinds of parameter thousands of times.
_Memo = dict[tuple[object, ...], _Metadata]


def _metadata(name: str, tensor: torch.Tensor, device: torch.device) -> _Metadata:
    shape = tuple(int(size) for size in tensor.shape)
    stride = tuple(int(step) for step in tensor.stride())
    dtype = dtype_name(tensor.dtype)
    itemsize = tensor.element_size()
    where = str(device)
    # The rules of a ParamSpec, checked once for all parameters with this metadata (the
    # name and storage key, which differ, torch and `storage_key` make valid).
    ParamSpec(name=name, shape=shape, stride=stride, dtype=dtype, itemsize=itemsize, device=where)
    numel, nbytes = param_sizes(shape, stride, itemsize)
    return (shape, stride, dtype, itemsize, where, device.type == "meta", numel, nbytes,
            _key_suffix(shape, stride, dtype))


#: (name, tensor) pairs of one layer, names relative to it; None tensors are skipped.
_Named = Iterable[tuple[str, torch.Tensor | None]]


_PARAMETER, _TENSOR = nn.Parameter, torch.Tensor


class _Wrapped(Exception):
    """Raised by `_describe` at a wrapper subclass (`is_wrapper`): the layer is described
    again with its wrappers expanded (`expand_wrappers`)."""


def _describe(layer_index: int, named: _Named, memo: _Memo) -> tuple[ParamSpec, ...]:
    """`describe_tensor` of each named tensor (None ones skipped), with the metadata of a
    kind of parameter already seen taken from `memo`: what is left per parameter is its
    name and storage key. One loop for a whole layer, as a large model has tens of
    thousands of parameters.

    Args:
        layer_index: for errors.
        named: (name, tensor) pairs.
        memo: the `_Metadata` of the kinds seen so far.
    """
    specs: list[ParamSpec] = []
    append, build, strided = specs.append, trusted_param_spec, _STRIDED
    for name, tensor in named:
        if tensor is None:
            continue
        if type(tensor) is not _PARAMETER and type(tensor) is not _TENSOR and is_wrapper(tensor):
            raise _Wrapped(name)
        if tensor.layout is not strided:  # layouts are singletons, equal only to themselves
            raise PlanError(
                f"layer {layer_index}: parameter {name!r} has layout {tensor.layout}; "
                "only strided (dense) tensors can be offloaded",
                name=name,
                value=str(tensor.layout),
            )
        device = tensor.device
        try:
            kind = (tensor.shape, tensor.stride(), tensor.dtype, device)
            try:
                meta = memo[kind]
            except KeyError:
                meta = memo[kind] = _metadata(name, tensor, device)
        except TypeError:  # symbolic sizes do not hash: describe this one on its own
            meta = _metadata(name, tensor, device)
        shape, stride, dtype, itemsize, where, is_meta, numel, nbytes, suffix = meta
        # storage_key(tensor) from the parts in `meta` (the same text: a test holds them equal).
        key: str | None
        try:
            storage = tensor.untyped_storage()
            if is_meta:
                key = f"meta@storage{hex(storage._cdata)}+{tensor.storage_offset()}{suffix}"
            else:
                pointer = storage.data_ptr()
                key = f"{where}@{hex(pointer)}+{tensor.storage_offset()}{suffix}" if pointer != 0 else None
        except (RuntimeError, NotImplementedError, AttributeError):
            key = None
        append(build(name, shape, stride, dtype, itemsize, key, where, numel, nbytes))
    return tuple(specs)


_NAMED_PARAMETERS = nn.Module.named_parameters
_NAMED_MEMBERS = nn.Module._named_members
_NAMED_MODULES = nn.Module.named_modules
_OBJECT_HASH = object.__hash__


def _walked_as_module(kind: type[nn.Module]) -> bool:
    """Whether torch walks a module of class `kind` as it walks ``nn.Module``: its
    ``named_modules`` is ``nn.Module``'s, and its hash the identity's (that
    ``named_modules`` hashes each module, checking it against the modules seen; a class
    with a hash of its own, or none, is left to torch, which calls it or fails as it
    does)."""
    return kind.named_modules is _NAMED_MODULES and kind.__hash__ is _OBJECT_HASH


def _gather(prefix: str, module: nn.Module, out: list[tuple[str, torch.Tensor | None]]) -> bool:
    """Append to `out` the parameters of `module` and its submodules, named and ordered
    as ``named_modules(remove_duplicate=False)`` then each module's ``_parameters``
    give them (None ones included, as there), in one walk.

    Args:
        prefix: the name of `module` in its layer ("" for the layer); names are
            ``prefix + "." + name`` where the prefix is not empty, as torch makes them.
        module: a module `_walked_as_module`.
        out: where the pairs go.

    Returns:
        False, with `out` partly filled, at the first submodule that is not
        `_walked_as_module` (the caller then asks torch); True otherwise.
    """
    dot = f"{prefix}." if prefix else ""
    append = out.append
    for name, tensor in module._parameters.items():
        append((dot + name, tensor))
    for name, child in module._modules.items():
        if child is None:
            continue
        if not _walked_as_module(type(child)):
            return False
        sub = dot + name
        if child._modules:
            if not _gather(sub, child, out):
                return False
            continue
        # A module without submodules (most of them): its parameters without a call.
        sub_dot = f"{sub}." if sub else ""
        for relative, tensor in child._parameters.items():
            append((sub_dot + relative, tensor))
    return True


def _named_parameters(layer: nn.Module) -> _Named:
    """``layer.named_parameters(remove_duplicate=False)`` as `_describe` reads it: the
    same names and tensors in the same order, and None entries (which it skips) between
    them (a test holds them equal).

    Where `layer` and all its submodules are walked as ``nn.Module`` walks them, the
    pairs are read off each module's ``_modules`` and ``_parameters`` in one recursive
    walk (`_gather`). ``named_parameters`` walks the same modules through a generator
    per module (``named_modules``), checking each against a set of modules seen and each
    parameter against one of parameters seen (both always empty without removing
    duplicates, but each check hashes, the parameter's in Python): in a layer of many
    small modules, the larger part of describing it. Where `layer` walks its own way,
    torch's ``named_modules`` walks (or, where it lists its parameters its own way, its
    ``named_parameters``).
    """
    kind = type(layer)
    if kind.named_parameters is not _NAMED_PARAMETERS or kind._named_members is not _NAMED_MEMBERS:
        return layer.named_parameters(remove_duplicate=False)
    if _walked_as_module(kind):
        pairs: list[tuple[str, torch.Tensor | None]] = []
        if _gather("", layer, pairs):
            return pairs
    # A module walked its own way: torch's walk, each module's parameters as above.
    return ((f"{prefix}.{name}" if prefix else name, tensor)
            for prefix, module in layer.named_modules(remove_duplicate=False)
            for name, tensor in module._parameters.items())


def describe_tensor(layer_index: int, name: str, tensor: torch.Tensor) -> ParamSpec:
    """The `ParamSpec` of one parameter's tensor, from its metadata only.

    Raises:
        PlanError: the tensor is not dense (strided), or is a wrapper subclass (a quantised
            weight: `describe_layers` describes its inner tensors, one spec each).
    """
    try:
        return _describe(layer_index, ((name, tensor),), {})[0]
    except _Wrapped:
        names = inner_names(layer_index, name, tensor)
        raise PlanError(f"layer {layer_index}: parameter {name!r} is a tensor subclass whose data are the inner "
                        f"tensors {', '.join(map(repr, names))}: describe each of them (describe_layers does)",
                        name=name, value=type(tensor).__qualname__) from None


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
        bytes. A quantised weight (a wrapper tensor subclass) is listed as its inner
        tensors, named and ordered as the layer holds them while offloaded
        (`offload.model.wrappers`). `ModelSpec.experts` lists the experts modules of
        its mixture-of-experts layers, found by shape (`offload.model.experts`).

    Raises:
        PlanError: `layers` is not iterable (e.g. a single layer), an
            element is not an ``nn.Module``, a parameter is not a dense tensor, or a
            quantised one cannot be unpacked (`offload.model.wrappers.inner_names`).
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
    groups: list[ExpertGroup] = []
    memo: _Memo = {}
    for index, item in enumerate(given):
        layer: object = item
        if not isinstance(layer, nn.Module):
            raise PlanError(
                f"layers[{index}] is a {type(layer).__name__}, not a torch.nn.Module",
                name=f"layers[{index}]",
                value=layer,
            )
        try:
            params = _describe(index, _named_parameters(layer), memo)
        except _Wrapped:  # a quantised weight: its inner tensors, named as once unpacked
            params = _describe(index, expand_wrappers(index, list(_named_parameters(layer))), memo)
        # Built without checking again: indices count from 0 here, and the names of one
        # module's named_parameters() are unique.
        specs.append(trusted_layer_spec(index, type(layer).__name__, params))
        groups.extend(find_experts(index, layer, specs[-1]))
    return trusted_model_spec(tuple(specs), (), tuple(groups))


def describe_stacks(stacks: Sequence[Iterable[nn.Module]]) -> ModelSpec:
    """The `ModelSpec` of a model with several layer stacks (an encoder and a decoder, a
    vision tower and a language model), in the order they run: their layers one after the
    other, as `describe_layers` describes them (ties across stacks included), with
    `ModelSpec.stacks` counting each stack's layers, so that each is prefetched as a cycle
    of its own. Wrap the same concatenated layers (``[*stack_a, *stack_b]``).

    Raises:
        PlanError: no stack, an empty stack, or a layer in two stacks; as `describe_layers`.
    """
    given = [list(stack) for stack in stacks]
    if not given or any(not stack for stack in given):
        raise PlanError(f"describe_stacks takes one or more non-empty stacks of layers, got "
                        f"{[len(stack) for stack in given]} layers per stack", name="stacks",
                        value=tuple(len(stack) for stack in given))
    layers = [layer for stack in given for layer in stack]
    seen: dict[int, int] = {}
    for number, stack in enumerate(given):
        for layer in stack:
            other = seen.setdefault(id(layer), number)
            if other != number:
                raise PlanError(f"a {type(layer).__name__} is in stacks {other} and {number}: a layer belongs to "
                                "one stack", name="stacks", value=(other, number))
    spec = describe_layers(layers)
    if len(given) == 1:
        return spec
    return trusted_model_spec(spec.layers, tuple(len(stack) for stack in given), spec.experts)
