"""The expert cache (Note [expert cache]) on a real CUDA device, with torch-only MoE models
(the lent machine has no transformers): fused experts routed by indices, in transformers'
layout and call convention (`benchmarks.bench_moe.MoeLayer`), and a ``ModuleList`` of
experts (`tests.hf.moe_list`). Every layer offloaded through two slots, so consecutive
MoE layers take turns in one set of expert rows (`BufferPlan.shared`).

What only a GPU shows: the misses' copies on the copy stream and the hits' device copies
on the compute stream ordered so that the outputs stay bit for bit the resident model's,
also when a long kernel before each layer keeps the compute stream busy while the next
layer's copies could start; the bytes copied equal to what `replay` predicts from the
recorded trace; one device buffer of rows per key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from benchmarks.bench_moe import MoeLayer, StackShape, fill_weights
from offload import OffloadConfig, capture_env
from offload.executors.experts import record_routing
from offload.hf import offload_model
from offload.pure.experts.replay import replay
from tests.hf.moe_list import ListMoeModel

EVERY_LAYER = OffloadConfig(backend="prefetch", group_size=1, prefetch_step=2, expert_slots=4)
SHAPE = StackShape(layers=6, experts=16, top_k=2, hidden=256, inter=128, dtype=torch.float32)
#: Tokens per forward: a prefill that routes to nearly every expert, then decode steps.
TOKENS = (64, 1, 1, 4, 1, 16, 1, 1)


class FusedModel(nn.Module):
    """`SHAPE.layers` fused-experts layers, run one after another."""

    def __init__(self) -> None:
        super().__init__()
        layers = [MoeLayer(SHAPE) for _ in range(SHAPE.layers)]
        fill_weights(layers, SHAPE, torch.device("cpu"), zipf=1.0)
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs(model: nn.Module) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    for tokens in TOKENS:
        if isinstance(model, ListMoeModel):
            yield torch.randint(0, 64, (1, tokens), generator=generator).cuda()
        else:
            yield torch.randn(1, tokens, SHAPE.hidden, generator=generator).cuda()


def _outputs(model: nn.Module) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(x).cpu() for x in _inputs(model)]


def _busy_before_each_layer(layers: nn.ModuleList) -> list[torch.utils.hooks.RemovableHandle]:
    """A long kernel on the compute stream before each layer: a copy into the rows not
    ordered after the previous layer's reads would then land while they run."""
    return [layer.register_forward_pre_hook(lambda *_: torch.cuda._sleep(2_000_000))  # type: ignore[no-untyped-call]
            for layer in layers]


@pytest.mark.parametrize("build", [FusedModel, lambda: ListMoeModel(6, hidden=128, inner=96, experts=8, top_k=2)],
                         ids=["fused-indices", "module-list-calls"])
@pytest.mark.parametrize("busy", [False, True], ids=["plain", "busy-compute-stream"])
def test_the_expert_cache_is_bit_for_bit_the_resident_model_on_cuda(build: type[nn.Module], busy: bool) -> None:
    model = build()
    resident = copy.deepcopy(model).cuda()
    expected = _outputs(resident)
    del resident
    offloader = offload_model(model, EVERY_LAYER, env=capture_env())
    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    plan = offloader.plan
    assert len(plan.experts) == len(layers)
    assert any(b.shared for b in plan.buffers)
    hooks = _busy_before_each_layer(layers) if busy else []
    with record_routing(list(layers)) as record:
        got = _outputs(model)
    for hook in hooks:
        hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # The rows: one storage per shared key for every layer.
    for cache in plan.experts:
        for name in cache.group.params:
            first = layers[plan.experts[0].layer].get_parameter(name)
            assert layers[cache.layer].get_parameter(name).data_ptr() == first.data_ptr()
    predicted = replay(plan.experts, record.trace())
    measured = offloader.stats().experts
    assert [(c.hits, c.misses) for c in measured] == [(g.hits, g.misses) for g in predicted.groups]
    assert sum(c.bytes_copied for c in measured) == predicted.total_bytes > 0
    offloader.restore()
