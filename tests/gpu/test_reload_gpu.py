"""New weights and changes after post_init on a real CUDA device: load_weights
then CUDA graph replay, load_state_dict routed into pinned host copies (parameters on
device slots pointed at host memory while torch copies, and back), writes in place
refused, conversions of the real weights, a layer kept in its own slot across replays.

Skipped without CUDA (see conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from offload import ExecutionError, OffloadConfig
from tests.executors.models import bits, layer_list
from tests.gpu.test_prefetch_gpu import ReplayPair, gpu_inputs, gpu_model, offload, plan_for

STEP2 = OffloadConfig(group_size=1, prefetch_step=2)


# 3 layers at step 2: position 1 is alone in its slot (loaded once, kept), and must be
# loaded again with the new weights.
@pytest.mark.parametrize("layers", [6, 3], ids=["shared-slots", "one-layer-kept"])
def test_load_weights_then_replay_computes_with_the_new_weights(layers: int) -> None:
    model = gpu_model(layers)
    twin = copy.deepcopy(model)
    fresh = gpu_model(layers, seed=1)
    reference = copy.deepcopy(fresh)
    off = offload(model, plan_for(model, STEP2))
    xs = list(gpu_inputs(seed=40, count=3))
    pair = ReplayPair(model, twin, off, xs[0])  # captured with the old weights
    pair.replay(xs[0], sync=True)
    off.load_weights(fresh.state_dict())
    for x in xs:  # the same graph, the new weights: the slots are refilled before each replay
        off.sync_prev_onload()
        pair.graph.replay()
        torch.testing.assert_close(pair.out, reference(x), atol=2e-2, rtol=2e-2)
    for x in xs:
        assert torch.equal(model(x), reference(x))  # eager: bit for bit
    off.restore()
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(bits(p), bits(fresh.get_parameter(name))), name


def test_load_state_dict_is_routed_into_the_pinned_host_copies() -> None:
    model = gpu_model(4)
    fresh = gpu_model(4, seed=2)
    off = offload(model, plan_for(model, STEP2))
    x = next(gpu_inputs(seed=41, count=1))
    model(x)
    model.load_state_dict(fresh.state_dict())  # tensors on the device, host copies pinned
    for p in off.plan.offloaded_params:
        assert layer_list(model)[p.layer].get_parameter(p.name).device.type == "cuda"  # on their slots again
    for x in gpu_inputs(seed=42, count=3):
        assert torch.equal(model(x), fresh(x))
    assert off.stats().realignments == 0
    off.restore()


def test_a_write_in_place_into_a_slot_is_refused() -> None:
    model = gpu_model(4)
    off = offload(model, plan_for(model, STEP2))
    layer = off.plan.offloaded_layers[1]
    with torch.no_grad():
        layer_list(model)[layer].get_parameter("mlp.up.weight").mul_(2)
    with pytest.raises(ExecutionError, match="written in place"):
        model(next(gpu_inputs(seed=43, count=1)))
    off.restore()


def test_to_dtype_converts_each_layers_own_weights() -> None:
    model = gpu_model(6)
    reference = copy.deepcopy(model).to(torch.float32)
    off = offload(model, plan_for(model, OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1)))
    model(next(gpu_inputs(seed=44, count=1)))
    model.cuda()  # changes nothing: still runs
    model(next(gpu_inputs(seed=45, count=1)))
    model.to(torch.float32)
    with pytest.raises(ExecutionError, match="changed after post_init"):
        model(next(gpu_inputs(seed=46, count=1)).float())
    off.restore()
    for name, want in reference.named_parameters():
        got = model.get_parameter(name)
        assert got.dtype == torch.float32 and got.device.type == "cuda" and torch.equal(got, want), name
