"""Rendering the expert caches and a replay (`offload.pure.experts.render`): layers of one
shape share a line, and the replay line gives the hit rate beside Belady's."""

from __future__ import annotations

import pytest

from offload.pure.experts.render import layer_runs, render_caches, render_replay
from offload.pure.experts.replay import belady, replay
from offload.pure.experts.values import CachePolicy
from tests.pure.experts.cases import plan, trace_of


@pytest.mark.parametrize(("layers", "text"), [((), ""), ((3,), "3"), ((0, 1, 2, 3), "0-3"), ((5, 0, 1, 7, 8, 9, 1),
                                                                                                 "0-1, 5, 7-9")])
def test_layer_runs(layers: tuple[int, ...], text: str) -> None:
    assert layer_runs(layers) == text


def test_layers_of_one_shape_share_a_line() -> None:
    plans = tuple(plan(64, 8 if layer != 5 else 4, held=(1, 2) if layer == 9 else (), layer=layer,
                       expert_bytes=3 << 20) for layer in range(48))
    assert render_caches(plans).splitlines() == [
        "expert cache: 48 layers, 1.11 GiB on the device",
        "  layers 0-4, 6-8, 10-47  mlp.experts: E 64 x 3.0 MiB, C 8 slots = 24.0 MiB each, none held, policy lru",
        "  layer 5                 mlp.experts: E 64 x 3.0 MiB, C 4 slots = 12.0 MiB each, none held, policy lru",
        "  layer 9                 mlp.experts: E 64 x 3.0 MiB, C 8 slots = 24.0 MiB each, held experts 1-2, "
        "policy lru",
    ]


def test_one_cache_and_none() -> None:
    assert render_caches(()) == "expert cache: none"
    assert render_caches((plan(8, 1, policy=CachePolicy.LFU, expert_bytes=100),)) == (
        "expert cache: 1 layer, 100 B on the device\n"
        "  layer 0  mlp.experts: E 8 x 100 B, C 1 slot = 100 B each, none held, policy lfu")


def test_the_replay_line() -> None:
    cache = plan(4, 1, expert_bytes=1 << 20)
    trace = trace_of((cache,), tuple((c,) for c in [(0,), (1,), (0,), (1,), (0,)]))
    assert render_replay(replay((cache,), trace), belady((cache,), trace)) == (
        "expert cache replay: 0.0% hits (Belady's optimum 40.0%) of 5 routed, 5 steps, 1.0 MiB per step from the host "
        "(5.0 MiB)")
    assert render_replay(replay((cache,), trace_of((cache,), (((0,),),)))) == (
        "expert cache replay: 0.0% hits of 1 routed, 1 step, 1.0 MiB per step from the host (1.0 MiB)")
