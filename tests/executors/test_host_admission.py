"""`wrap_modules` refuses a plan whose host memory does not fit, before it moves anything:
a snapshot built by hand with a small cgroup limit, on both
offloading backends; ``host_check="warn"`` lets it through with a logged warning."""

from __future__ import annotations

import copy
import logging

import attrs
import pytest
import torch
from torch import nn

from offload import (
    EnvSnapshot,
    ExecutionError,
    OffloadConfig,
    OffloadPlan,
    WarningCode,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.executors import NoopOffloader
from offload.protocols import Offloader
from offload.pure import CgroupMemory, HostCheck, HostFit, HostLimit
from tests.executors.fakes import FakeRuntime, HostCopy
from tests.executors.helpers import CUDA_LIKE, assert_restored, inputs, on_compute_device, snapshot
from tests.executors.models import layer_list, transformer_model

#: A container allowing 4 KiB more than it uses, on a host with plenty available.
SMALL_CONTAINER = attrs.evolve(
    CUDA_LIKE,
    host_available_bytes=64 << 30,
    cgroup_memory=CgroupMemory(version=2, limit_bytes=1 << 20, current_bytes=(1 << 20) - 4096,
                               limit_path="/sys/fs/cgroup/ctr/memory.max", cgroup_path="/ctr"),
)

CONFIGS = {
    "prefetch": OffloadConfig(group_size=1, prefetch_step=1),
    "uva": OffloadConfig(uva_max_bytes=1 << 40),
}


def plan_for(model: nn.Module, backend: str, host_check: HostCheck) -> OffloadPlan:
    """The plan a CUDA machine in `SMALL_CONTAINER` makes: every weight on the device,
    so each offloaded one needs a new (pinned) host copy."""
    config = attrs.evolve(CONFIGS[backend], host_check=host_check)
    return make_plan(on_compute_device(describe_layers(layer_list(model))), config,
                     EnvSnapshot(platform=SMALL_CONTAINER))


def offloader(plan: OffloadPlan, runtime: FakeRuntime) -> Offloader:
    off = create_offloader(plan, runtime)
    assert type(off).__name__ == {"prefetch": "PrefetchOffloader", "uva": "UVAOffloader"}[plan.backend.value]
    return off


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_a_plan_over_the_cgroup_limit_is_refused_with_the_model_untouched(backend: str) -> None:
    model = transformer_model(3)
    layers = layer_list(model)
    before = snapshot(model)
    plan = plan_for(model, backend, "refuse")
    admission = plan.host_admission
    assert (admission.verdict, admission.binding) == (HostFit.DOES_NOT_FIT, HostLimit.CGROUP)
    assert admission.host_bytes > 4096
    runtime = FakeRuntime()
    off = offloader(plan, runtime)
    with pytest.raises(ExecutionError) as caught:
        off.wrap_modules(layers)
    error = caught.value
    assert error.name == "cgroup"
    assert error.value == (admission.host_bytes, 4096)
    message = str(error)
    assert "nothing was moved" in message
    assert "the container allows 4.0 KiB more" in message
    assert "cgroup v2 memory.max at /sys/fs/cgroup/ctr" in message
    assert "host_check='warn'" in message
    # Nothing moved: the same Parameter objects, values, devices and storage; no host
    # copy taken, no hook installed, no mark left (another offloader may wrap them).
    assert_restored(model, before, same_storage=True)
    assert runtime.entries(HostCopy) == []
    assert all("forward" not in layer.__dict__ for layer in layers)
    allowed = create_offloader(attrs.evolve(plan, config=attrs.evolve(plan.config, host_check="off")), FakeRuntime())
    allowed.wrap_modules(layers)
    allowed.restore()
    assert_restored(model, before, same_storage=False)


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_warn_lets_it_through_with_a_logged_warning_and_a_plan_warning(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    plan = plan_for(model, backend, "warn")
    assert plan.host_admission.verdict is HostFit.DOES_NOT_FIT
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
    assert "host_check='warn'" in warning.message
    runtime = FakeRuntime()
    off = offloader(plan, runtime)
    with caplog.at_level(logging.WARNING):
        off.wrap_modules(layer_list(model))
    records = [r for r in caplog.records if "host memory check" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "the container allows 4.0 KiB more" in records[0].getMessage()
    assert len(runtime.entries(HostCopy)) == sum(p.tied_to is None for p in plan.offloaded_params)
    off.post_init()
    for x in inputs(seed=3):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert_restored(model, before, same_storage=False)


@pytest.mark.parametrize("mode", ["refuse", "warn", "off"])
def test_a_plan_that_fits_is_never_refused_or_warned_about(mode: HostCheck, caplog: pytest.LogCaptureFixture) -> None:
    model = transformer_model(2)
    roomy = attrs.evolve(SMALL_CONTAINER, cgroup_memory=attrs.evolve(SMALL_CONTAINER.cgroup_memory, current_bytes=0))
    config = attrs.evolve(CONFIGS["prefetch"], host_check=mode)
    plan = make_plan(on_compute_device(describe_layers(layer_list(model))), config, EnvSnapshot(platform=roomy))
    assert plan.host_admission.verdict is HostFit.FITS
    off = offloader(plan, FakeRuntime())
    with caplog.at_level(logging.WARNING):
        off.wrap_modules(layer_list(model))
    assert not [r for r in caplog.records if "host memory check" in r.getMessage()]
    off.restore()


def _does_not_fit(plan: OffloadPlan) -> OffloadPlan:
    """`plan` with the verdict of a plan over the limit (for a backend that takes none)."""
    other = plan_for(transformer_model(3), "prefetch", "refuse")
    return attrs.evolve(plan, host_admission=other.host_admission)


def test_the_noop_executor_takes_no_host_memory_and_checks_nothing() -> None:
    model = transformer_model(2)
    before = snapshot(model)
    plan = make_plan(on_compute_device(describe_layers(layer_list(model))), OffloadConfig(backend="none"),
                     EnvSnapshot(platform=SMALL_CONTAINER))
    off = create_offloader(_does_not_fit(plan), FakeRuntime())
    assert isinstance(off, NoopOffloader)
    off.wrap_modules(layer_list(model))  # no ExecutionError
    off.restore()
    assert_restored(model, before, same_storage=False)

