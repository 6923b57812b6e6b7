"""Hypothesis strategies for the values of the pure core.

Shapes are kept small (the core never touches data, but the tests' own brute-force
oracles enumerate elements), names come from a pool that exercises whole-segment filter
matching, and about one parameter in ten is tied to an earlier one through a shared
``storage_key``. Only valid configurations are generated; the invalid ones are tables in
``test_config.py``.
"""

from __future__ import annotations

import functools

import attrs
from hypothesis import strategies as st

from offload.pure import (
    BackendName,
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    ParamSpec,
    Platform,
)
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.env.numa import NumaTopology

__all__ = [
    "BACKENDS",
    "DEVICES",
    "DTYPES",
    "FILTER_SEGMENTS",
    "PARAM_NAMES",
    "cgroup_memories",
    "env_flags",
    "env_snapshots",
    "layer_specs",
    "model_specs",
    "numa_topologies",
    "offload_configs",
    "param_specs",
    "platforms",
    "row_major",
    "shapes",
]

#: dtype name -> bytes per element, written from the torch documentation (not read from
#: the code under test); includes integer and float8 dtypes, which have no ``finfo``.
DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: Parameter names as ``named_parameters()`` gives them relative to a layer. Several share
#: dotted parts, so that filters can match some and not others.
PARAM_NAMES: tuple[str, ...] = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.up.weight",
    "mlp.up.bias",
    "mlp.experts.w2_weight",
    "mlp.experts.w2_weight_scale",
    "mlp.shared_experts.w2_weight",
    "mlp.experts.w13_weight",
    "bias",
)

#: Filter segments: some match a few of `PARAM_NAMES` as whole parts, some match none.
FILTER_SEGMENTS: tuple[str, ...] = (
    "experts.w2_weight",
    "w2_weight",
    "weight",
    "mlp",
    "self_attn.q_proj",
    "up",
    "no_such_param",
)

#: Where parameters live: not yet loaded, on the GPU, on the host, or placeholders.
DEVICES: tuple[str, ...] = ("compute", "cuda:0", "cpu", "meta")


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides in elements, written independently of the code under test.

    A zero-size dimension counts as size 1 for the strides of the dimensions before it,
    as torch does (``torch.empty(3, 0).stride() == (1, 1)``).
    """
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * max(shape[i + 1], 1)
    return tuple(out)


def shapes(*, max_dims: int = 3, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of 0..max_dims dimensions, sides 0..max_side (zero-size dims included)."""
    return st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims).map(tuple)


# Strategies are built once: building them inside every draw dominates the run time.
_STRIDE_KIND = st.sampled_from(("contiguous", "permuted", "padded", "broadcast"))
_PAD = st.integers(0, 3)
_BOOL = st.booleans()
_DTYPE = st.sampled_from(sorted(DTYPES))
_NAME = st.sampled_from(PARAM_NAMES)
_PICK = st.integers(0, 63)
_ONE_IN_TEN = st.integers(0, 9)
_ONE_IN_EIGHT = st.integers(0, 7)


@functools.cache
def _permutations(ndim: int) -> st.SearchStrategy[list[int]]:
    return st.permutations(range(ndim))


@functools.cache
def _one_of(values: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.sampled_from(values)


@functools.cache
def _shapes(max_side: int) -> st.SearchStrategy[tuple[int, ...]]:
    return shapes(max_side=max_side)


@functools.cache
def _name_lists(max_params: int) -> st.SearchStrategy[list[str]]:
    return st.lists(_NAME, max_size=max_params, unique=True)


def _strides(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous, permuted (a transposed view), padded (a slice) or broadcast strides."""
    kind = draw(_STRIDE_KIND)
    if kind == "contiguous" or not shape:
        return row_major(shape)
    if kind == "permuted":
        # The strides of a contiguous tensor of permuted shape, permuted back: a view such
        # as ``w.t()`` or ``w.permute(...)``.
        order = draw(_permutations(len(shape)))
        base = row_major(tuple(shape[i] for i in order))
        stride = [0] * len(shape)
        for position, dim in enumerate(order):
            stride[dim] = base[position]
        return tuple(stride)
    if kind == "padded":
        # Row-major over a larger buffer: a slice ``big[:, :k]``.
        return row_major(tuple(size + draw(_PAD) for size in shape))
    # Broadcast: some dimensions with stride 0 (``expand``).
    return tuple(0 if draw(_BOOL) else step for step in row_major(shape))


@st.composite
def param_specs(
    draw: st.DrawFn,
    *,
    name: str | None = None,
    devices: tuple[str, ...] = DEVICES,
    max_side: int = 6,
) -> ParamSpec:
    """A parameter: any of `DTYPES`, non-contiguous strides, zero-size dims, any device."""
    shape = draw(_shapes(max_side))
    dtype = draw(_DTYPE)
    return ParamSpec(
        name=name if name is not None else draw(_NAME),
        shape=shape,
        stride=_strides(draw, shape),
        dtype=dtype,
        itemsize=DTYPES[dtype],
        device=draw(_one_of(devices)),
    )


@st.composite
def layer_specs(draw: st.DrawFn, *, index: int = 0, max_params: int = 5) -> LayerSpec:
    """A layer with unique parameter names (no ties; `model_specs` adds those)."""
    params = tuple(draw(param_specs(name=n)) for n in draw(_name_lists(max_params)))
    return LayerSpec(index=index, name=f"model.layers.{index}", params=params)


@st.composite
def model_specs(
    draw: st.DrawFn,
    *,
    min_layers: int = 0,
    max_layers: int = 10,
    max_params: int = 5,
    devices: tuple[str, ...] = DEVICES,
) -> ModelSpec:
    """A model whose parameters sometimes share storage with an earlier one (tied).

    A tied parameter is the same tensor under another name (same shape, stride, dtype,
    device and storage key), in the same layer or a later one.
    """
    num_layers = draw(st.integers(min_layers, max_layers))
    shareable: list[ParamSpec] = []
    layers: list[LayerSpec] = []
    for index in range(num_layers):
        params: list[ParamSpec] = []
        for name in draw(_name_lists(max_params)):
            if shareable and draw(_ONE_IN_TEN) == 0:
                params.append(attrs.evolve(shareable[draw(_PICK) % len(shareable)], name=name))
                continue
            param = draw(param_specs(name=name, devices=devices))
            if draw(_ONE_IN_EIGHT) == 0:
                param = attrs.evolve(param, storage_key=f"storage-{index}-{name}")
                shareable.append(param)
            params.append(param)
        layers.append(LayerSpec(index=index, name=f"model.layers.{index}", params=tuple(params)))
    return ModelSpec(layers=tuple(layers))


#: Every backend name a config accepts.
BACKENDS: tuple[BackendName, ...] = ("auto", "prefetch", "uva", "none")


@st.composite
def offload_configs(draw: st.DrawFn, *, max_budget: int = 20_000) -> OffloadConfig:
    """A valid config for every backend, including auto with both or neither configured."""
    backend = draw(st.sampled_from(BACKENDS))
    min_group = 1 if backend == "prefetch" else 0
    group_size = draw(st.integers(min_group, 9))
    num_in_group = draw(st.integers(1, group_size)) if group_size > 0 else 1
    min_budget = 1 if backend == "uva" else 0
    uva_max_bytes = draw(st.one_of(st.just(min_budget), st.integers(min_budget, max_budget)))
    return OffloadConfig(
        backend=backend,
        group_size=group_size,
        num_in_group=num_in_group,
        prefetch_step=draw(st.integers(1, 5)),
        uva_max_bytes=uva_max_bytes,
        param_filter=tuple(draw(st.lists(st.sampled_from(FILTER_SEGMENTS), max_size=2, unique=True))),
        keep_host_params=draw(st.booleans()),
        numa_node=draw(st.sampled_from(("auto", None))),  # a node number may not exist on the platform drawn
        host_check=draw(st.sampled_from(("refuse", "warn", "off"))),
    )


def env_flags() -> st.SearchStrategy[EnvFlags]:
    """Any combination of the user's switches."""
    return st.builds(EnvFlags, disable_pin_memory=st.booleans(), disable_uva=st.booleans())


_OPTIONAL_BYTES = st.one_of(st.none(), st.integers(0, 1 << 40))


@st.composite
def platforms(draw: st.DrawFn) -> Platform:
    """A machine with or without CUDA; the CUDA fields vary only when it has CUDA."""
    has_cuda = draw(st.booleans())
    cuda = st.booleans() if has_cuda else st.just(False)
    return Platform(
        has_cuda=has_cuda,
        device_name=draw(st.sampled_from(("NVIDIA H200", "NVIDIA GH200 480GB", "Orin"))) if has_cuda else "cpu",
        device_total_bytes=draw(st.integers(0, 1 << 40)) if has_cuda else 0,
        is_integrated=draw(cuda),
        pageable_memory_access=draw(cuda),
        pageable_uses_host_page_tables=draw(cuda),
        can_map_host_memory=draw(cuda),
        can_register_host_memory=draw(cuda),
        host_pointer_for_registered_memory=draw(cuda),
        is_wsl=draw(st.booleans()),
        memlock_limit_bytes=draw(_OPTIONAL_BYTES),
        host_available_bytes=draw(_OPTIONAL_BYTES),
        torch_version=draw(st.sampled_from(("", "2.13.0+cpu", "2.11.0+cu130"))),
        numa=draw(numa_topologies(has_cuda=has_cuda)),
        cgroup_memory=draw(cgroup_memories()),
    )


@st.composite
def cgroup_memories(draw: st.DrawFn) -> CgroupMemory:
    """Unknown, unlimited (v1 or v2) or limited cgroups, usage read or not."""
    version = draw(st.sampled_from((0, 1, 2)))
    if version == 0:
        return CgroupMemory()
    limit = draw(_OPTIONAL_BYTES)
    return CgroupMemory(
        version=version,
        limit_bytes=limit,
        current_bytes=draw(_OPTIONAL_BYTES),
        reclaimable_bytes=draw(_OPTIONAL_BYTES),
        limit_path=f"/sys/fs/cgroup/x/{'memory.max' if version == 2 else 'memory.limit_in_bytes'}",
        cgroup_path="/x",
    )


@st.composite
def numa_topologies(draw: st.DrawFn, *, has_cuda: bool = True) -> NumaTopology:
    """Unknown, single-node or multi-node hosts; a GPU node only with CUDA (unknown or -1 too)."""
    nodes = tuple(sorted(draw(st.sets(st.integers(0, 7), max_size=4))))
    gpu_node = draw(st.one_of(st.none(), st.sampled_from(nodes or (0, 1)))) if has_cuda else None
    return NumaTopology(nodes=nodes, gpu_node=gpu_node)


def env_snapshots() -> st.SearchStrategy[EnvSnapshot]:
    """A snapshot of any flags on any platform."""
    return st.builds(EnvSnapshot, flags=env_flags(), platform=platforms())
