"""Several layer stacks in one prefetch offloader (Note [cycles]): an encoder that runs
once per request and a decoder that runs once per token each prefetch on their own cycle,
with slots of their own. Outputs stay the resident ones bit for bit in every order the
stacks run in, and no run realigns, since each cycle finds its copies in flight whatever
the other did. Copies are deferred until waited on (`FakeRuntime(defer=True)`), so a layer
that read a slot before its copy landed would give a wrong result."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload import EnvSnapshot, OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.executors import PrefetchOffloader
from tests.executors.fakes import Copy, FakeRuntime
from tests.executors.helpers import inputs, prefetch
from tests.executors.models import TransformerBlock

ENCODER, DECODER = 3, 4


def _stacks() -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    return nn.ModuleList(TransformerBlock() for _ in range(ENCODER)), nn.ModuleList(TransformerBlock()
                                                                                     for _ in range(DECODER))


def _plan(encoder: nn.ModuleList, decoder: nn.ModuleList, config: OffloadConfig) -> OffloadPlan:
    spec = describe_layers([*encoder, *decoder])
    return make_plan(attrs.evolve(spec, stacks=(ENCODER, DECODER)), config, EnvSnapshot())


def _run(stack: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in stack:
        x = layer(x)
    return x


CONFIGS = [
    OffloadConfig(group_size=1, prefetch_step=2),
    OffloadConfig(group_size=1, prefetch_step=1),
    OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2),
    OffloadConfig(group_size=1, prefetch_step=3),  # the encoder's 3 layers each alone in a slot
]


def _ready(config: OffloadConfig) -> tuple[tuple[nn.ModuleList, nn.ModuleList], tuple[nn.ModuleList, nn.ModuleList],
                                          PrefetchOffloader, FakeRuntime]:
    encoder, decoder = _stacks()
    reference = copy.deepcopy((encoder, decoder))
    runtime = FakeRuntime(defer=True)
    off = prefetch(_plan(encoder, decoder, config), runtime)
    off.wrap_modules([*encoder, *decoder])
    off.post_init()
    return (encoder, decoder), reference, off, runtime


@pytest.mark.parametrize("config", CONFIGS)
def test_the_plan_has_a_cycle_per_stack_with_slots_of_its_own(config: OffloadConfig) -> None:
    encoder, decoder = _stacks()
    plan = _plan(encoder, decoder, config)
    ranges = plan.schedule.cycle_ranges
    assert len(ranges) == 2
    layers = plan.offloaded_layers
    assert all(layers[i] < ENCODER for i in range(*ranges[0]))
    assert all(layers[i] >= ENCODER for i in range(*ranges[1]))
    assert {plan.schedule.slots[i] for i in range(*ranges[0])}.isdisjoint(
        plan.schedule.slots[i] for i in range(*ranges[1]))


@pytest.mark.parametrize("config", CONFIGS)
def test_a_decoder_run_per_token_prefetches_without_realigning(config: OffloadConfig) -> None:
    (encoder, decoder), (ref_encoder, ref_decoder), off, _ = _ready(config)
    for request in range(2):
        x = next(inputs(seed=request))
        memory, expected = _run(encoder, x), _run(ref_encoder, x)
        assert torch.equal(memory, expected)
        for _token in range(5):
            memory, expected = _run(decoder, memory), _run(ref_decoder, expected)
            assert torch.equal(memory, expected)
    assert off.stats().realignments == 0
    off.restore()
    for stack, ref in ((encoder, ref_encoder), (decoder, ref_decoder)):
        assert all(torch.equal(a, b) for a, b in zip(stack.parameters(), ref.parameters(), strict=True))


def test_each_run_of_the_decoder_copies_only_the_decoders_layers() -> None:
    (encoder, decoder), _, off, runtime = _ready(OffloadConfig(group_size=1, prefetch_step=2))
    x = next(inputs(seed=1))
    x = _run(encoder, x)
    plan = off.plan
    # One copy per decoder weight with a buffer of its own (this runtime makes no layer
    # blocks): nothing of the encoder's cycle is copied while the decoder runs.
    decoder_weights = sum(1 for p in plan.offloaded_params if p.layer >= ENCODER and p.tied_to is None)
    for _token in range(3):
        before = len([e for e in runtime.log if isinstance(e, Copy)])
        x = _run(decoder, x)
        assert len([e for e in runtime.log if isinstance(e, Copy)]) - before == decoder_weights


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.sampled_from(["encoder", "decoder"]), min_size=1, max_size=8),
       config=st.sampled_from(CONFIGS))
def test_any_order_of_whole_stack_runs_is_exact(order: list[str], config: OffloadConfig) -> None:
    (encoder, decoder), (ref_encoder, ref_decoder), off, _ = _ready(config)
    x = y = next(inputs(seed=5))
    for which in order:
        stack, ref = (encoder, ref_encoder) if which == "encoder" else (decoder, ref_decoder)
        x, y = _run(stack, x), _run(ref, y)
        assert torch.equal(x, y)
    assert off.stats().realignments == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_a_realignment_in_one_stack_leaves_the_other_prefetching(config: OffloadConfig) -> None:
    (encoder, decoder), (ref_encoder, ref_decoder), off, _ = _ready(config)
    x = next(inputs(seed=2))
    memory, expected = _run(encoder, x), _run(ref_encoder, x)
    last = off.plan.offloaded_layers[-1] - ENCODER  # the decoder's last offloaded layer
    assert torch.equal(decoder[last](memory), ref_decoder[last](expected))  # out of order: realigns
    assert off.stats().realignments == 1
    for _ in range(3):
        memory, expected = _run(decoder, memory), _run(ref_decoder, expected)
        assert torch.equal(memory, expected)
    assert torch.equal(_run(encoder, x), _run(ref_encoder, x))
    # Counted once: the decoder's next whole run began its new step while realigning, and
    # the encoder, prefetched all along, did not realign.
    assert off.stats().realignments == 1


def test_a_step_is_a_run_of_a_stack() -> None:
    (encoder, decoder), _, off, _ = _ready(OffloadConfig(group_size=1, prefetch_step=2))
    x = _run(encoder, next(inputs(seed=1)))
    for _token in range(4):
        x = _run(decoder, x)
    assert off.stats().steps == 1 + 4


def test_new_weights_for_one_stack_refill_only_its_cycle_and_are_no_realignment() -> None:
    (encoder, decoder), (ref_encoder, ref_decoder), off, runtime = _ready(OffloadConfig(group_size=1, prefetch_step=2))
    x = next(inputs(seed=6))
    memory = _run(encoder, x)
    _run(decoder, memory)
    torch.manual_seed(9)
    new = {k: torch.randn_like(v) for k, v in ref_decoder.state_dict().items()}
    ref_decoder.load_state_dict(new)
    decoder.load_state_dict(new)  # routed into the host copies
    before = len([e for e in runtime.log if isinstance(e, Copy)])
    assert torch.equal(_run(encoder, x), _run(ref_encoder, x))
    encoder_copies = len([e for e in runtime.log if isinstance(e, Copy)]) - before
    assert torch.equal(_run(decoder, memory), _run(ref_decoder, _run(ref_encoder, x)))
    assert off.stats().realignments == 0
    # The encoder's run copied what a run copies, no refill of its unchanged weights on top.
    plan = off.plan
    per_run = sum(1 for p in plan.offloaded_params if p.layer < ENCODER and p.tied_to is None)
    kept = sum(1 for p in plan.offloaded_params if p.layer < ENCODER and p.tied_to is None
               and plan.offloaded_layers.index(p.layer) in plan.schedule.kept_positions)
    assert encoder_copies == per_run - kept
