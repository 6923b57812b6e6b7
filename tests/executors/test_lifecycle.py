"""The lifecycle, as one table (`offload.executors.lifecycle`), obeyed by both executors:
every call in every state either runs or is refused with an `ExecutionError` naming the
state; while a restore is unfinished, the refusal says so."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from offload import ExecutionError, OffloadConfig, create_offloader
from tests.executors.fakes import FakeRuntime
from tests.executors.faults import FaultyRuntime, make_error
from tests.executors.helpers import inputs, pinned_plan
from tests.executors.models import layer_list, transformer_model
from tests.executors.uva_helpers import on_demand_plan

#: Which calls each state allows, written out by hand (the design, not the code's table).
#: Before wrapping and after a restore the model carries no hook of ours: its forward is
#: the plain model's. Wrapped, before post_init, an offloaded layer refuses to run.
EXPECTED = {
    "new": {"wrap_modules", "forward"},
    "wrapped": {"post_init", "load_weights", "check", "restore"},
    "ready": {"forward", "sync_prev_onload", "load_weights", "check", "restore"},
    "restoring": {"restore"},
    "restored": {"forward"},
}
CALLS = ("wrap_modules", "post_init", "forward", "sync_prev_onload", "load_weights", "check", "restore")
PLANS = {
    "prefetch": lambda m: pinned_plan(m, OffloadConfig(group_size=1, prefetch_step=2)),
    "on-demand": on_demand_plan,
}


def _in_state(kind: str, state: str) -> tuple[object, torch.nn.Sequential]:
    model = transformer_model(3)
    runtime = FaultyRuntime(FakeRuntime())
    off = create_offloader(PLANS[kind](model), runtime)
    if state != "new":
        off.wrap_modules(layer_list(model))
    if state in ("ready", "restoring", "restored"):
        off.post_init()
    if state == "restoring":
        runtime.reset_counts()
        runtime.arm("copy_to", 0, lambda: make_error("runtime", "copy_to", 0))
        with pytest.raises(ExecutionError, match="restore stopped after giving back"):
            off.restore()
    if state == "restored":
        off.restore()
    return off, model


def _call(off: object, model: torch.nn.Sequential, call: str) -> Callable[[], object]:
    if call == "wrap_modules":
        return lambda: off.wrap_modules(layer_list(model))  # type: ignore[attr-defined]
    if call == "forward":
        def forward() -> object:
            with torch.no_grad():
                return model(next(inputs(seed=1)))
        return forward
    if call == "load_weights":
        return lambda: off.load_weights({})  # type: ignore[attr-defined]
    return getattr(off, call)  # type: ignore[no-any-return]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("state", list(EXPECTED))
@pytest.mark.parametrize("kind", list(PLANS))
def test_each_call_runs_exactly_in_the_states_that_allow_it(kind: str, state: str, call: str) -> None:
    off, model = _in_state(kind, state)
    if call in EXPECTED[state]:
        _call(off, model, call)()
        return
    with pytest.raises(ExecutionError) as info:
        _call(off, model, call)()
    assert info.value.name == "state"
    assert info.value.value == state
    if state == "restoring":
        assert "restore() stopped part way and did not finish" in str(info.value)
    else:
        assert f"(state {state})" in str(info.value)
