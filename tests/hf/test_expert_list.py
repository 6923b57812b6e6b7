"""Experts held as a ``ModuleList`` of expert MLPs (`Routing.CALLS`, `tests.hf.moe_list`):
found by shape beside their router, served one by one as the block calls them, outputs bit
for bit the resident model's, each step's bytes exactly the non-expert copies plus the
misses, and the recorded trace replayed to the executor's counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from offload.executors.experts import record_routing
from offload.hf.model import offload_stacks
from offload.model.describe import describe_layers
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.replay import replay
from offload.pure.spec.experts import Routing
from offload.runtime.cpu import CpuRuntime
from tests.hf.moe_list import Expert, ListMoeModel

EVERY_LAYER = OffloadConfig(group_size=1, prefetch_step=2)
#: A prefill of 8 tokens in 2 sequences, then three steps of one token each.
INPUTS = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))] + [
    torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(s)) for s in (2, 3, 4)]


def _outputs(model: nn.Module) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(ids) for ids in INPUTS]


def _offload(model: ListMoeModel, config: OffloadConfig = EVERY_LAYER) -> Any:
    return offload_stacks(model, [model.layers], config, env=EnvSnapshot(), runtime=CpuRuntime())


def test_the_list_is_found_beside_its_router_as_e_experts_of_b_bytes() -> None:
    model = ListMoeModel(3, hidden=16, inner=24, experts=8)
    groups = describe_layers(model.layers).experts
    assert [(g.layer, g.module, g.num_experts, g.routing) for g in groups] == [
        (i, "block_sparse_moe.experts", 8, Routing.CALLS) for i in range(3)]
    group = groups[0]
    assert group.expert_bytes == 3 * 16 * 24 * 4
    assert group.kinds == 3 and len(group.params) == 24
    assert group.expert_params(5) == tuple(f"block_sparse_moe.experts.5.{w}.weight" for w in ("w1", "w3", "w2"))
    assert group.top_k == 2  # the block's top_k (ListMoeModel's default), beside the list


def test_a_list_of_modules_alike_without_a_router_is_not_experts() -> None:
    layer = nn.Module()
    layer.blocks = nn.ModuleList(Expert(8, 8) for _ in range(4))
    layer.proj = nn.Linear(8, 8)  # [8, 8]: not [4, X]
    assert describe_layers([layer]).experts == ()
    layer.router = nn.Linear(8, 4)  # [4, 8] beside the list: a router
    assert [g.num_experts for g in describe_layers([layer]).experts] == [4]
    unlike = nn.Module()
    unlike.gate = nn.Linear(8, 2)
    unlike.experts = nn.ModuleList([Expert(8, 8), Expert(8, 16)])
    assert describe_layers([unlike]).experts == ()


@pytest.mark.parametrize("slots", [None, 1, 3, 8])
def test_outputs_are_bit_for_bit_the_resident_models(slots: int | None) -> None:
    expected = _outputs(ListMoeModel())
    model = ListMoeModel()
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=slots))
    assert [c.slots for c in offloader.plan.experts] == [slots or 1] * 3  # default: 8 // 8
    got = _outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    stats = offloader.stats()
    assert all(c.hits + c.misses > 0 for c in stats.experts)
    offloader.restore()
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), expected, strict=True))
    assert all(type(e).forward is Expert.forward and "forward" not in vars(e)
               for e in model.modules() if isinstance(e, Expert))  # every expert's forward given back


def test_each_step_copies_the_non_expert_weights_and_the_misses_exactly_as_replay_predicts() -> None:
    model = ListMoeModel(4)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=3))
    plan = offloader.plan
    expert_refs = {(c.layer, name) for c in plan.experts for name in c.group.params}
    copied_layers = {layer for position, layer in enumerate(plan.offloaded_layers)
                     if position not in plan.schedule.kept_positions}
    non_expert = sum(p.nbytes for p in plan.offloaded_params
                     if (p.layer, p.name) not in expert_refs and p.layer in copied_layers)
    expert_bytes = plan.experts[0].group.expert_bytes
    totals = []
    with record_routing(list(model.layers)) as record, torch.inference_mode():
        for ids in INPUTS:
            totals.append((offloader.stats().bytes_copied, sum(c.misses for c in offloader.stats().experts)))
            model(ids)
    totals.append((offloader.stats().bytes_copied, sum(c.misses for c in offloader.stats().experts)))
    for step in range(1, len(INPUTS)):  # each step's layer copies are issued during the one before
        got = totals[step + 1][0] - totals[step][0]
        assert got == non_expert + (totals[step + 1][1] - totals[step][1]) * expert_bytes, step
    trace = record.trace()
    assert len(trace.steps) == len(INPUTS)
    predicted = replay(plan.experts, trace)
    counts = offloader.stats().experts
    assert [(g.hits, g.misses, g.evictions) for g in predicted.groups] == [(c.hits, c.misses, c.evictions)
                                                                         for c in counts]
    assert predicted.total_bytes == sum(c.bytes_copied for c in counts)
    offloader.restore()


def test_an_expert_not_called_is_not_copied() -> None:
    model = ListMoeModel(2, top_k=1)
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_slots=2))
    with torch.inference_mode():
        model(torch.tensor([[7]]))  # one token, one expert per layer
    counts = offloader.stats().experts
    assert [c.misses for c in counts] == [1, 1]
    assert [c.bytes_copied for c in counts] == [offloader.plan.experts[0].group.expert_bytes] * 2
    offloader.restore()


def test_expert_cache_off_streams_the_list_with_its_layer() -> None:
    expected = _outputs(ListMoeModel())
    model = ListMoeModel()
    offloader = _offload(model, OffloadConfig(group_size=1, prefetch_step=2, expert_cache=False))
    assert offloader.plan.experts == ()
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), expected, strict=True))
    offloader.restore()
