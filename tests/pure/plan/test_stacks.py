"""Plans of models with several layer stacks (`ModelSpec.stacks`): one schedule cycle per
stack with offloaded layers, slots of its own, every plan rule held, JSON round trips,
the text says so, and a revision keeps the cycles."""

from __future__ import annotations

import attrs
import pytest

from offload import (
    EnvSnapshot,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    PlanError,
    WarningCode,
    make_plan,
    render_plan,
    schedule_prefetch,
)
from offload.pure.plan.revise import revise_plan
from tests.pure.plan.test_revise import GPU, spec

ENCODER, DECODER = 3, 5


def stacked(encoder: int = ENCODER, decoder: int = DECODER) -> ModelSpec:
    return attrs.evolve(spec(encoder + decoder), stacks=(encoder, decoder))


def test_a_spec_names_its_stacks_or_is_one() -> None:
    assert stacked().stack_ranges == ((0, 3), (3, 8))
    assert spec(4).stack_ranges == ((0, 4),)
    assert ModelSpec(layers=()).stack_ranges == ()
    for bad in ((3, 4), (8, 0), (-1, 9)):
        with pytest.raises(PlanError, match="stacks"):
            attrs.evolve(spec(8), stacks=bad)


@pytest.mark.parametrize("config", [OffloadConfig(group_size=1, prefetch_step=2),
                                    OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2),
                                    OffloadConfig(group_size=1, prefetch_step=4)])
def test_each_stack_with_offloaded_layers_is_a_cycle(config: OffloadConfig) -> None:
    plan = make_plan(stacked(), config, GPU)
    layers = plan.offloaded_layers
    encoder = sum(1 for layer in layers if layer < ENCODER)
    assert plan.schedule.cycles == (encoder, len(layers) - encoder)
    first, second = plan.schedule.cycle_ranges
    assert {plan.schedule.slots[i] for i in range(*first)}.isdisjoint(plan.schedule.slots[i] for i in range(*second))
    step = config.prefetch_step
    assert plan.schedule.num_slots == min(step, encoder) + min(step, len(layers) - encoder)
    # Every rule of a plan holds (the constructor checks them), and JSON gives it back.
    assert OffloadPlan(**{f.name: getattr(plan, f.name) for f in attrs.fields(OffloadPlan)}) == plan
    assert OffloadPlan.from_json(plan.to_json()) == plan
    assert "cycles:   layers " in render_plan(plan)


def test_one_stack_with_offloaded_layers_is_the_one_cycle_plan() -> None:
    config = OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2)
    only_decoder = attrs.evolve(spec(8), stacks=(1, 7))
    plan = make_plan(only_decoder, config, GPU)
    assert plan.offloaded_layers == (1, 3, 5, 7) and plan.schedule.cycles == ()
    assert plan.schedule == make_plan(spec(8), config, GPU).schedule
    assert "cycles:" not in render_plan(plan)


def test_more_slots_than_one_cycle_would_take_are_counted_in_the_device_bytes() -> None:
    config = OffloadConfig(group_size=1, prefetch_step=2)
    one = make_plan(spec(8), config, GPU)
    two = make_plan(stacked(), config, GPU)
    assert two.schedule.num_slots == 4 and one.schedule.num_slots == 2
    assert two.device_bytes_buffers == 2 * one.device_bytes_buffers


def test_a_revision_keeps_a_cycle_per_stack() -> None:
    plan = make_plan(stacked(), OffloadConfig(group_size=1, prefetch_step=2), GPU)
    gone = {(4, name): None for name in ("w", "b", "extra")}  # a decoder layer loses everything
    revised = revise_plan(plan, gone)
    assert revised.offloaded_layers == (0, 1, 2, 3, 5, 6, 7)
    assert revised.schedule.cycles == (3, 4)
    assert OffloadPlan.from_json(revised.to_json()) == revised
    emptied = revise_plan(plan, {(layer, name): None for layer in range(ENCODER) for name in ("w", "b", "extra")})
    assert emptied.schedule.cycles == ()  # the encoder left the plan: one cycle


def test_a_plan_without_cycles_reads_as_before() -> None:
    plan = make_plan(spec(4), OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot())
    text = plan.to_json().replace(', "cycles": []', "")
    assert '"cycles"' not in text
    assert OffloadPlan.from_json(text) == plan


def test_the_prefetch_warnings_look_at_each_stack() -> None:
    config = OffloadConfig(group_size=1, prefetch_step=3)
    stalls = [w.message for w in make_plan(stacked(3, 4), config, GPU).warnings if w.code is WarningCode.PREFETCH_STALLS]
    assert len(stalls) == 1 and stalls[0].startswith("4 consecutive layers")  # the decoder's, not all 7
    covered = make_plan(stacked(3, 3), config, GPU)
    assert WarningCode.PREFETCH_DEPTH_COVERS_ALL in {w.code for w in covered.warnings}  # each stack keeps its slots
    assert WarningCode.PREFETCH_STALLS not in {w.code for w in covered.warnings}


def test_a_cycle_that_is_not_the_positions_is_refused() -> None:
    with pytest.raises(PlanError, match="cycles"):
        schedule_prefetch(5, 2, (3,))
