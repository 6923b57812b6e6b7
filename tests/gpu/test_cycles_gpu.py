"""Several layer stacks on a real GPU (Note [cycles]): an encoder run once and a decoder
run once per token, each prefetched on its own cycle with real streams and events, give
the resident outputs bit for bit without realigning; and a CUDA graph of the decoder
alone (the decode step of a serving loop) replays exactly between eager encoder runs."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.executors import PrefetchOffloader
from offload.graphs import capture_forward
from tests.executors.models import layer_list
from tests.gpu.test_prefetch_gpu import env_with_pinning, gpu_inputs, gpu_model

ENCODER, DECODER = 3, 4


def _stacks() -> tuple[nn.Sequential, nn.Sequential]:
    return gpu_model(ENCODER, seed=0), gpu_model(DECODER, seed=1)


def _plan(encoder: nn.Sequential, decoder: nn.Sequential, config: OffloadConfig) -> OffloadPlan:
    spec = describe_layers([*layer_list(encoder), *layer_list(decoder)])
    plan = make_plan(attrs.evolve(spec, stacks=(ENCODER, DECODER)), config, env_with_pinning(True))
    assert plan.compute_device == "cuda" and len(plan.schedule.cycle_ranges) == 2
    return plan


def _offload(encoder: nn.Sequential, decoder: nn.Sequential, config: OffloadConfig) -> PrefetchOffloader:
    from offload import create_offloader

    off = create_offloader(_plan(encoder, decoder, config))
    assert isinstance(off, PrefetchOffloader)
    off.wrap_modules([*layer_list(encoder), *layer_list(decoder)])
    off.post_init()
    return off


CONFIGS = [
    pytest.param(OffloadConfig(group_size=1, prefetch_step=2), id="every-layer-step2"),
    pytest.param(OffloadConfig(group_size=2, prefetch_step=1), id="every-2nd-step1"),
    pytest.param(OffloadConfig(group_size=1, prefetch_step=3), id="encoder-kept"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_decoder_per_token_with_real_streams(config: OffloadConfig) -> None:
    encoder, decoder = _stacks()
    ref_encoder, ref_decoder = copy.deepcopy(encoder), copy.deepcopy(decoder)
    off = _offload(encoder, decoder, config)
    with torch.inference_mode():
        for x in gpu_inputs(seed=4, count=2):
            memory, expected = encoder(x), ref_encoder(x)
            assert torch.equal(memory, expected)
            for _token in range(6):
                memory, expected = decoder(memory), ref_decoder(expected)
                assert torch.equal(memory, expected)
    assert off.stats().realignments == 0
    off.restore()


def test_a_graph_of_the_decoder_alone_replays_exactly_between_encoder_runs() -> None:
    encoder, decoder = _stacks()
    ref_encoder, ref_decoder = copy.deepcopy(encoder), copy.deepcopy(decoder)
    off = _offload(encoder, decoder, OffloadConfig(group_size=1, prefetch_step=2))
    xs = list(gpu_inputs(seed=5, count=3))
    with torch.inference_mode():
        first = encoder(xs[0])
    static = first.clone()
    graph, out = capture_forward(decoder, static, off)
    ref_static = ref_encoder(xs[0]).clone()
    ref_graph, ref_out = capture_forward(ref_decoder, ref_static, None)
    for x in xs:
        with torch.inference_mode():
            memory, expected = encoder(x), ref_encoder(x)  # eager, between replays
        assert torch.equal(memory, expected)
        static.copy_(memory)
        ref_static.copy_(expected)
        off.sync_prev_onload()
        graph.replay()
        ref_graph.replay()
        assert torch.equal(out, ref_out)
    off.restore()
