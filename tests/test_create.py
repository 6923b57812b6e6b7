"""create_offloader: the executor a plan asks for, with the runtime its platform needs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from offload import (
    Backend,
    EnvSnapshot,
    ExecutionError,
    OffloadConfig,
    OffloadPlan,
    PlanError,
    create_offloader,
    describe_layers,
    make_plan,
    protocols,
)
from offload.create import default_runtime
from offload.executors import NoopOffloader, PrefetchOffloader, UVAOffloader
from offload.runtime.cpu import CpuRuntime
from offload.runtime.cuda import CudaRuntime
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, cuda_like_plan, pinned_plan
from tests.executors.models import layer_list, transformer_model


def test_backend_none_gives_a_noop_offloader() -> None:
    off = create_offloader(cpu_plan(transformer_model(2), OffloadConfig(backend="none")))
    assert isinstance(off, NoopOffloader)
    assert off.plan.backend is Backend.NONE


def test_auto_with_nothing_configured_gives_a_noop_offloader() -> None:
    plan = cpu_plan(transformer_model(2), OffloadConfig())
    assert plan.backend is Backend.NONE
    assert isinstance(create_offloader(plan), NoopOffloader)


def test_backend_prefetch_gives_a_prefetch_offloader_running_that_plan() -> None:
    plan = cpu_plan(transformer_model(2), OffloadConfig(group_size=1))
    off = create_offloader(plan)
    assert isinstance(off, PrefetchOffloader)
    assert off.plan is plan


def test_backend_uva_gives_a_uva_offloader_running_that_plan() -> None:
    plan = cpu_plan(transformer_model(2), OffloadConfig(backend="uva", uva_max_bytes=1))
    assert plan.backend is Backend.UVA
    off = create_offloader(plan)
    assert isinstance(off, UVAOffloader)
    assert off.plan is plan
    assert isinstance(create_offloader(plan, CpuRuntime()), UVAOffloader)


@pytest.mark.parametrize(("executor", "config"), [
    (PrefetchOffloader, OffloadConfig(backend="uva", uva_max_bytes=1)),
    (UVAOffloader, OffloadConfig(group_size=1)),
    (NoopOffloader, OffloadConfig(backend="uva", uva_max_bytes=1)),
])
def test_an_executor_refuses_another_backends_plan(
    executor: Callable[[OffloadPlan, protocols.Runtime], protocols.Offloader], config: OffloadConfig
) -> None:
    plan = cpu_plan(transformer_model(2), config)
    with pytest.raises(PlanError, match=f"got (backend )?{plan.backend.value}") as info:
        executor(plan, CpuRuntime())
    assert (info.value.name, info.value.value) == ("backend", plan.backend.value)


def test_a_plan_for_the_cpu_runs_on_cpu_runtime_by_default() -> None:
    plan = cpu_plan(transformer_model(2), OffloadConfig(group_size=1))
    assert plan.compute_device == "cpu"
    assert isinstance(default_runtime(plan), CpuRuntime)


def test_a_plan_for_cuda_needs_cuda_for_its_default_runtime() -> None:
    plan = cuda_like_plan(transformer_model(2), OffloadConfig(group_size=1), disable_pin_memory=False)
    assert plan.compute_device == "cuda"
    if torch.cuda.is_available():
        runtime = default_runtime(plan)
        assert isinstance(runtime, CudaRuntime) and runtime.device.type == "cuda"
    else:
        with pytest.raises(ExecutionError, match="CUDA"):
            create_offloader(plan)


def test_cuda_runtime_without_cuda_raises_execution_error() -> None:
    if torch.cuda.is_available():
        assert CudaRuntime().device.type == "cuda"
        return
    with pytest.raises(ExecutionError, match="is_available") as info:
        CudaRuntime()
    assert (info.value.name, info.value.value) == ("device", "cuda")
    assert isinstance(info.value, RuntimeError)


def test_a_given_runtime_is_used() -> None:
    model = transformer_model(2)
    runtime = FakeRuntime()
    off = create_offloader(pinned_plan(model, OffloadConfig(group_size=1)), runtime)
    off.wrap_modules(layer_list(model))
    assert runtime.host_copies == len(off.plan.offloaded_params) > 0


@pytest.mark.parametrize("backend", ["none", "prefetch"])
def test_executors_satisfy_the_offloader_protocol(backend: str) -> None:
    model = transformer_model(2)
    config = OffloadConfig(backend="none") if backend == "none" else OffloadConfig(group_size=1)
    plan = make_plan(describe_layers(layer_list(model)), config, EnvSnapshot())
    assert isinstance(create_offloader(plan), protocols.Offloader)


def test_runtimes_satisfy_the_runtime_protocol() -> None:
    assert isinstance(CpuRuntime(), protocols.Runtime)
    assert isinstance(FakeRuntime(), protocols.Runtime)
    assert not isinstance(object(), protocols.Runtime)
