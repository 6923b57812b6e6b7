"""Plans, snapshots and comparisons shared by the executor tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import torch
from torch import nn

from offload import (
    EnvFlags,
    EnvSnapshot,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    Platform,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.executors import PrefetchOffloader, UVAOffloader
from offload.protocols import Runtime
from tests.executors.fakes import FakeRuntime
from tests.executors.models import HIDDEN, bits, layer_list

__all__ = [
    "CUDA_LIKE",
    "ParamState",
    "assert_restored",
    "cpu_plan",
    "cuda_like_plan",
    "inputs",
    "patched_layers",
    "pinned_plan",
    "prefetch",
    "snapshot",
    "tie_groups",
    "uva",
]

#: A CUDA platform as a plan sees it (nothing here touches a real GPU).
CUDA_LIKE = Platform(
    has_cuda=True,
    device_name="fake CUDA device",
    device_total_bytes=80 * 2**30,
    compute_capability="9.0",
    can_map_host_memory=True,
    can_register_host_memory=True,
)


def cpu_plan(model: nn.Module, config: OffloadConfig) -> OffloadPlan:
    """The plan for `model`'s layers on this machine without an accelerator."""
    return make_plan(describe_layers(layer_list(model)), config, EnvSnapshot())


def on_compute_device(spec: ModelSpec, device: str = "cuda:0") -> ModelSpec:
    """`spec` as if its parameters were on `device` (so a CUDA plan offloads them)."""
    return ModelSpec(layers=tuple(
        attrs.evolve(layer, params=tuple(attrs.evolve(p, device=device) for p in layer.params))
        for layer in spec.layers
    ))


def cuda_like_plan(
    model: nn.Module, config: OffloadConfig, *, disable_pin_memory: bool, disable_uva: bool = False
) -> OffloadPlan:
    """The plan a CUDA machine would make for `model`, with the pin and UVA switches as given."""
    env = EnvSnapshot(flags=EnvFlags(disable_pin_memory=disable_pin_memory, disable_uva=disable_uva),
                      platform=CUDA_LIKE)
    return make_plan(on_compute_device(describe_layers(layer_list(model))), config, env)


def pinned_plan(model: nn.Module, config: OffloadConfig) -> OffloadPlan:
    """The plan a CUDA machine with pinning on would make for `model`: run on a CPU
    runtime's fake, every offloaded weight is copied into (played) page-locked memory
    (`Move.HOST_TO_PINNED`), so host copies happen and can be counted or failed."""
    return cuda_like_plan(model, config, disable_pin_memory=False)


def prefetch(plan: OffloadPlan, runtime: Runtime | None = None) -> PrefetchOffloader:
    """`create_offloader(plan, runtime)`, checked to be the prefetch executor."""
    offloader = create_offloader(plan, runtime)
    assert isinstance(offloader, PrefetchOffloader)
    return offloader


def uva(plan: OffloadPlan, runtime: Runtime | None = None) -> UVAOffloader:
    """`create_offloader(plan, runtime)`, checked to be the UVA executor; a plan made for
    a CUDA-like platform runs on a `FakeRuntime` unless `runtime` is given."""
    if runtime is None and plan.compute_device == "cuda":
        runtime = FakeRuntime()
    offloader = create_offloader(plan, runtime)
    assert isinstance(offloader, UVAOffloader)
    return offloader


@attrs.frozen(eq=False)
class ParamState:
    """One parameter name's object, data pointer, metadata and bits at one moment."""

    param: nn.Parameter
    ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device
    bits: torch.Tensor


def snapshot(model: nn.Module) -> dict[str, ParamState]:
    """Every parameter name (tied names too) with a copy of its bits."""
    return {
        name: ParamState(param=p, ptr=p.data_ptr(), dtype=p.dtype, shape=tuple(p.shape),
                         stride=tuple(p.stride()), device=p.device, bits=bits(p).clone())
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def assert_restored(model: nn.Module, before: dict[str, ParamState], *, same_storage: bool) -> None:
    """Every name holds the same Parameter object with the same dtype, shape, strides,
    device and bits as in `before`; with `same_storage`, at the same address too."""
    now = dict(model.named_parameters(remove_duplicate=False))
    assert sorted(now) == sorted(before)
    for name, was in before.items():
        p = now[name]
        assert p is was.param, name
        assert (p.dtype, tuple(p.shape), tuple(p.stride()), p.device) == (
            was.dtype, was.shape, was.stride, was.device), name
        assert torch.equal(bits(p), was.bits), name
        if same_storage:
            assert p.data_ptr() == was.ptr, name


def tie_groups(model: nn.Module) -> set[frozenset[str]]:
    """Names grouped by the data pointer they share (groups of two or more)."""
    by_ptr: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(p.data_ptr(), set()).add(name)
    return {frozenset(names) for names in by_ptr.values() if len(names) > 1}


def patched_layers(layers: Sequence[nn.Module]) -> list[int]:
    """Indices of layers with an instance-level ``forward`` (the executor's hook)."""
    return [i for i, layer in enumerate(layers) if "forward" in layer.__dict__]


def inputs(seed: int, shapes: Sequence[tuple[int, int]] = ((2, 5), (1, 3), (3, 7), (2, 5))) -> Iterator[torch.Tensor]:
    """Different activations (batch, tokens, HIDDEN), one per shape, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    for batch, tokens in shapes:
        yield torch.randn(batch, tokens, HIDDEN, generator=generator)
