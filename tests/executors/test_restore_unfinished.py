"""A restore that stopped part way: the next forward says so, as an
`ExecutionError`, on every layer (it used to raise ``IndexError`` in the prefetch backend,
and run half-restored weights elsewhere); the error of the restore says how far it got,
whatever the runtime raised; a second `restore` finishes bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadError, OffloadPlan, create_offloader
from tests.executors.fakes import FakeRuntime
from tests.executors.faults import FaultyRuntime, make_error
from tests.executors.helpers import assert_restored, inputs, patched_layers, pinned_plan, snapshot
from tests.executors.models import layer_list, transformer_model
from tests.executors.uva_helpers import on_demand_plan, view_plan

#: Bytes of one `TransformerBlock` of the test models (3264 float32 parameters).
LAYER_BYTES = 3264 * 4

PLANS = {
    "prefetch-pinned": lambda m: pinned_plan(m, OffloadConfig(group_size=2, prefetch_step=1)),
    "prefetch-pinned-every-layer": lambda m: pinned_plan(m, OffloadConfig(group_size=1, prefetch_step=2)),
    "uva": lambda m: view_plan(m, 2 * LAYER_BYTES),  # layers 0 and 1; 2 and 3 stay resident
    "on-demand-pinned": lambda m: on_demand_plan(m),
}


def _setup(kind: str) -> tuple[nn.Sequential, nn.Sequential, FaultyRuntime, object, dict[str, object]]:
    model = transformer_model(4)
    reference = copy.deepcopy(model)
    plan: OffloadPlan = PLANS[kind](model)
    runtime = FaultyRuntime(FakeRuntime())
    off = create_offloader(plan, runtime)
    before = snapshot(model)
    off.wrap_modules(layer_list(model))
    off.post_init()
    if kind == "uva":
        assert sorted({p.layer for p in plan.offloaded_params}) == [0, 1]  # layers without a hook of their own
    x = next(inputs(seed=1))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    return model, reference, runtime, off, before  # type: ignore[return-value]


@pytest.mark.parametrize("error", ["execution", "runtime"])
@pytest.mark.parametrize("kind", list(PLANS))
def test_every_layer_refuses_to_run_until_a_second_restore_finishes(kind: str, error: str) -> None:
    model, reference, runtime, off, before = _setup(kind)
    runtime.reset_counts()
    runtime.arm("copy_to", 1, lambda: make_error(error, "copy_to", 1))  # the second storage given back fails
    with pytest.raises(ExecutionError, match=r"restore stopped after giving back 1 of \d+ storages") as info:
        off.restore()  # type: ignore[attr-defined]
    assert runtime.fired is not None
    assert info.value.__cause__ is runtime.fired
    assert "injected" in str(info.value)  # the cause's own words are kept
    if error == "execution":
        assert (info.value.name, info.value.value) == ("copy_to", 1)  # the runtime's name and value kept
    x = next(inputs(seed=2))
    for index, layer in enumerate(layer_list(model)):
        with pytest.raises(ExecutionError, match=r"restore\(\) stopped part way and did not finish") as refused:
            with torch.no_grad():
                layer(x)
        assert refused.value.name == "state", index
    with pytest.raises(ExecutionError, match="stopped part way"):
        with torch.no_grad():
            model(x)
    with pytest.raises(OffloadError, match="stopped part way"):
        off.load_weights({})  # type: ignore[attr-defined]
    off.restore()  # type: ignore[attr-defined]
    assert patched_layers(layer_list(model)) == []
    assert_restored(model, before, same_storage=False)  # type: ignore[arg-type]
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_restore_that_could_not_begin_leaves_the_model_running(kind: str) -> None:
    model, reference, runtime, off, before = _setup(kind)
    runtime.reset_counts()
    runtime.arm("synchronize", 0, lambda: make_error("runtime", "synchronize", 0))
    with pytest.raises(ExecutionError, match="nothing restored"):
        off.restore()  # type: ignore[attr-defined]
    x = next(inputs(seed=3))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # still offloaded, still exact
    off.restore()  # type: ignore[attr-defined]
    assert_restored(model, before, same_storage=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_restore_that_failed_only_its_last_wait_runs_the_restored_model(kind: str) -> None:
    model, reference, runtime, off, before = _setup(kind)
    runtime.reset_counts()
    runtime.arm("synchronize", 1, lambda: make_error("runtime", "synchronize", 1))  # the wait at the end
    with pytest.raises(ExecutionError, match="gave every weight back, but waiting for the device failed"):
        off.restore()  # type: ignore[attr-defined]
    x = next(inputs(seed=4))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # every weight is back: it runs exactly
    off.restore()  # type: ignore[attr-defined]
    assert_restored(model, before, same_storage=False)  # type: ignore[arg-type]
