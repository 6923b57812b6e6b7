"""`fit` over models of several layer stacks (one schedule cycle per stack, slots of its
own): the search's figures are those of each configuration's plan and estimate, its
bounds hold, and it is as fast as a brute-force oracle over every configuration."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import EnvFlags, EnvSnapshot, LayerSpec, ModelSpec, ParamSpec, PlanError
from tests.pure.fit.test_search import ENVS, TOKENS, check_prefetch_candidates, oracle, run

#: UVA off, so that the link is slow enough for prefetch to win some budgets.
NO_UVA = EnvSnapshot(flags=EnvFlags(disable_uva=True))
from tests.pure.strategies import model_specs


@st.composite
def stacked_specs(draw: st.DrawFn) -> ModelSpec:
    """A random model of 2 to 6 layers cut into 2 or 3 stacks."""
    spec = draw(model_specs(max_layers=6, max_params=3).filter(lambda s: len(s.layers) >= 2))
    n = len(spec.layers)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=min(2, n - 1))))
    bounds = [0, *cuts, n]
    return attrs.evolve(spec, stacks=tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False)))


@settings(max_examples=40, deadline=None)
@given(spec=stacked_specs(), env=ENVS, tokens=TOKENS, max_step=st.integers(1, 6), fraction=st.floats(0.0, 1.2))
def test_every_prefetch_candidate_of_a_stacked_model_is_what_its_plan_says(
        spec: ModelSpec, env: EnvSnapshot, tokens: int, max_step: int, fraction: float) -> None:
    check_prefetch_candidates(spec, env, tokens, max_step, int(spec.nbytes * fraction))


@settings(max_examples=30, deadline=None)
@given(spec=stacked_specs(), env=ENVS, tokens=TOKENS, fraction=st.floats(0.0, 1.2))
def test_fit_of_a_stacked_model_is_as_fast_as_the_best_fitting_configuration(
        spec: ModelSpec, env: EnvSnapshot, tokens: int, fraction: float) -> None:
    budget = int(spec.nbytes * fraction)
    best = oracle(spec, env, tokens, budget, 0, ())
    if best is None:
        with pytest.raises(PlanError, match="more than the budget"):
            run(spec, env, tokens, budget)
        return
    result = run(spec, env, tokens, budget)
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    plan = result.plan
    assert plan.device_bytes_resident + plan.device_bytes_buffers <= budget
    if len(plan.schedule.cycle_ranges) > 1:
        assert plan.schedule.cycles == tuple(stop - first for first, stop in plan.schedule.cycle_ranges)


def _uniform(stacks: tuple[int, ...], width: int = 8) -> ModelSpec:
    """Layers of one weight each (``width`` x ``width`` float32 on the device) cut into `stacks`."""
    layers = tuple(LayerSpec(index=i, name=f"l{i}", params=(
        ParamSpec(name="w", shape=(width, width), stride=(width, 1), dtype="float32", itemsize=4, storage_key=None,
                  device="cuda:0"),)) for i in range(sum(stacks)))
    return ModelSpec(layers=layers, stacks=stacks)


@pytest.mark.parametrize("stacks", [(2, 2), (1, 3), (3, 2), (2, 1, 2)])
@pytest.mark.parametrize("fraction", [0.4, 0.55, 0.7, 0.85])
@pytest.mark.parametrize("tokens", [50, 200])
def test_fit_of_stacks_matches_the_oracle_where_prefetch_wins(stacks: tuple[int, ...], fraction: float,
                                                               tokens: int) -> None:
    spec = _uniform(stacks)
    budget = int(spec.nbytes * fraction)
    best = oracle(spec, NO_UVA, tokens, budget, 0, ())
    assert best is not None
    result = run(spec, NO_UVA, tokens, budget)
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    plan = result.plan
    assert plan.device_bytes_resident + plan.device_bytes_buffers <= budget


def test_a_tight_budget_on_two_stacks_takes_a_slot_per_stack() -> None:
    spec = _uniform((2, 2))
    result = run(spec, NO_UVA, 200, int(spec.nbytes * 0.55))
    plan = result.plan
    assert plan.backend.value == "prefetch" and plan.schedule.cycles == (2, 2)
    assert plan.schedule.num_slots == 2  # one per stack at depth 1
    assert result.chosen.buffer_bytes == plan.device_bytes_buffers == 2 * 8 * 8 * 4
