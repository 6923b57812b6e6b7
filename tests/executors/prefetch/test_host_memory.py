"""The prefetch executor and host memory: pinning fallbacks, and restore releasing every
host copy it took."""

from __future__ import annotations

import copy

import pytest
import torch

from offload import ExecutionError, OffloadConfig
from tests.executors.fakes import FakeRuntime, HostCopy, Release
from tests.executors.helpers import assert_restored, cuda_like_plan, inputs, prefetch, snapshot
from tests.executors.models import layer_list, transformer_model


@pytest.mark.parametrize("fail_pin_at", [0, 7, 20])
def test_a_failed_pin_falls_back_to_pageable_and_the_model_keeps_working(fail_pin_at: int) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False)
    runtime = FakeRuntime(fail_pin_at=fail_pin_at)
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=5):
        assert torch.equal(model(x), reference(x))
    assert off.stats().pin_fallbacks == 1
    # A graph capture needs every copy pinned: refused, and the error says why.
    off.sync_prev_onload()
    runtime.capturing = True
    with pytest.raises(ExecutionError, match="pinning failed for 1 host copies") as info:
        model(next(inputs(seed=6)))
    assert info.value.name == "pin_fallbacks"


@pytest.mark.parametrize("disable_pin_memory", [False, True], ids=["pin-on", "pin-off"])
def test_restore_releases_every_host_copy_it_took(disable_pin_memory: bool) -> None:
    model = transformer_model(4)
    before = snapshot(model)
    plan = cuda_like_plan(model, OffloadConfig(group_size=2, prefetch_step=1), disable_pin_memory=disable_pin_memory)
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=8)))
    assert off.stats().host_bytes > 0
    off.restore()
    copies = runtime.entries(HostCopy)
    releases = runtime.entries(Release)
    storages = sum(p.tied_to is None for p in plan.offloaded_params)
    # Pinning off: the pageable weights are their own host copies (adopted, not copied).
    assert len(copies) == (0 if disable_pin_memory else storages)
    assert len(releases) == storages
    assert {r.pinned for r in releases} == {not disable_pin_memory}
    assert off.stats().host_bytes == 0
    assert_restored(model, before, same_storage=False)


def test_a_failed_wrap_releases_what_it_took() -> None:
    model = transformer_model(2)
    before = snapshot(model)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1), disable_pin_memory=False)
    runtime = FakeRuntime(fail_host_copy_at=5)
    off = prefetch(plan, runtime)
    with pytest.raises(ExecutionError, match="model left as it was"):
        off.wrap_modules(layer_list(model))
    assert len(runtime.entries(Release)) == 5
    assert_restored(model, before, same_storage=False)  # recovered from the released copies
