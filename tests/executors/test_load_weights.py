"""`load_weights`: new weights for an offloaded model without `restore`, as
engines reload after a reinforcement-learning update or a wake from sleep.

Every backend, ties (in a layer, across layers, two Parameters over one storage), a fused
weight split in views, int8 and float8 weights, buffers: the model then computes bit for
bit as a resident model holding the new weights, ``state_dict()`` reports them, `restore`
gives them back, and nothing is allocated in host memory."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, create_offloader
from offload.protocols import Offloader
from tests.executors.fakes import FakeRuntime, HostCopy, HostEmpty
from tests.executors.helpers import cpu_plan, pinned_plan, tie_groups
from tests.executors.models import (
    BufferBlock,
    FusedBlock,
    TiedBlock,
    bits,
    layer_list,
    mixed_model,
    transformer_model,
)
from tests.executors.uva_helpers import cpu_on_demand_plan, cross_layer_tied_model, on_demand_plan, view_plan

Plan = Callable[[nn.Module], OffloadPlan]

#: Prefetch with two slots shared by several layers, with every layer one slot's lone
#: owner (the step covers the count: each is loaded once, and must be loaded again), and
#: the other backends.
KINDS: dict[str, Plan] = {
    "prefetch": lambda m: cpu_plan(m, OffloadConfig(group_size=1, prefetch_step=2)),
    "prefetch-pinned": lambda m: pinned_plan(m, OffloadConfig(group_size=2, prefetch_step=2)),
    "prefetch-pinned-blocks": lambda m: pinned_plan(m, OffloadConfig(group_size=1, prefetch_step=2,
                                                                     layer_blocks="always")),
    "prefetch-lone-owners": lambda m: pinned_plan(m, OffloadConfig(group_size=1, prefetch_step=64)),
    "uva": lambda m: view_plan(m),
    "on-demand": lambda m: cpu_on_demand_plan(m),
    "on-demand-pinned": lambda m: on_demand_plan(m),
    "none": lambda m: cpu_plan(m, OffloadConfig(backend="none")),
}


def fused_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(FusedBlock(), BufferBlock(), FusedBlock(), TiedBlock())


MODELS: dict[str, Callable[[int], nn.Sequential]] = {
    "mixed": lambda seed: mixed_model(seed=seed),
    "cross-layer-ties": lambda seed: cross_layer_tied_model(seed=seed),
    "fused-views-buffers": fused_model,
}


def activations(seed: int, model: str) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((2, 5, 16), (1, 3, 16)) if model == "mixed" else ((2, 5, 16), (3, 16))
    for shape in shapes:
        yield torch.randn(*shape, generator=generator)


def offloaded(kind: str, model: nn.Module) -> tuple[Offloader, FakeRuntime]:
    runtime = FakeRuntime()
    off = create_offloader(KINDS[kind](model), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off, runtime


def same_state(model: nn.Module, other: nn.Module) -> bool:
    """Whether the state dicts have the same names and bits."""
    ours, theirs = model.state_dict(), other.state_dict()
    return sorted(ours) == sorted(theirs) and all(torch.equal(bits(ours[k]), bits(theirs[k])) for k in ours)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_new_weights_compute_as_a_resident_model_holding_them(kind: str, model_name: str) -> None:
    model = MODELS[model_name](0)
    fresh = MODELS[model_name](1)
    ties = tie_groups(model)
    off, runtime = offloaded(kind, model)
    with torch.no_grad():
        for x in activations(2, model_name):
            model(x)  # the slots hold the old weights of some layers
    host_bytes = off.stats().host_bytes
    logged = len(runtime.log)

    off.load_weights(fresh.state_dict())

    assert not [e for e in runtime.log[logged:] if isinstance(e, (HostCopy, HostEmpty))]  # nothing allocated
    assert off.stats().host_bytes == host_bytes
    with torch.no_grad():
        for x in activations(3, model_name):
            assert torch.equal(model(x), fresh(x))
    assert same_state(model, fresh)
    off.restore()
    assert same_state(model, fresh)
    assert tie_groups(model) == ties  # ties are ties again, views one storage again
    for layer in model:
        if isinstance(layer, FusedBlock):
            assert layer.q.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "uva", "on-demand"])
def test_pairs_one_at_a_time_and_a_prefix(kind: str) -> None:
    model = transformer_model(4)
    fresh = transformer_model(4, seed=1)
    off, _ = offloaded(kind, model)
    pairs = ((f"model.layers.{name}", tensor) for name, tensor in fresh.state_dict().items())
    off.load_weights(pairs, prefix="model.layers.")
    x = next(activations(4, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    off.restore()


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "on-demand-pinned"])
def test_values_are_converted_to_the_weights_dtype_as_load_state_dict_does(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    off, _ = offloaded(kind, model)
    off.load_weights({name: t.to(torch.float64) for name, t in fresh.state_dict().items()})
    x = next(activations(5, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32}
    off.restore()


# ---- refusals --------------------------------------------------------------------------------


def _old_outputs(model: nn.Module, reference: nn.Module) -> bool:
    x = next(activations(6, "mixed"))
    with torch.no_grad():
        return torch.equal(model(x), reference(x))


@pytest.mark.parametrize(("bad", "message"), [
    ({"9.mlp.up.weight": torch.zeros(64, 16)}, "is not <layer index>.<name in the layer> of the 3 wrapped layers"),
    ({"1.mlp.nope.weight": torch.zeros(64, 16)}, "has no parameter or buffer 'mlp.nope.weight'"),
    ({"mlp.up.weight": torch.zeros(64, 16)}, "is not <layer index>.<name in the layer>"),
    ({"1.mlp.up.weight": torch.zeros(16, 64)}, r"is \(16, 64\), the model's is \(64, 16\)"),
    ({"1.mlp.up.weight": torch.zeros(64, 16, device="meta")}, "on the meta device"),
    ({"1.mlp.up.weight": [[0.0]]}, "is a list, not a tensor"),
])
@pytest.mark.parametrize("kind", ["prefetch", "uva", "on-demand-pinned"])
def test_a_bad_entry_in_a_mapping_is_named_and_nothing_is_written(kind: str, bad: dict[str, object],
                                                                  message: str) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    fresh = transformer_model(3, seed=1)
    off, _ = offloaded(kind, model)
    weights: dict[str, object] = dict(fresh.state_dict())
    weights.update(bad)
    with pytest.raises(ExecutionError, match=message) as info:
        off.load_weights(weights)  # type: ignore[arg-type]
    assert info.value.name == next(iter(bad))
    assert _old_outputs(model, reference)  # nothing was written
    off.restore()
    assert same_state(model, reference)


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "uva"])
def test_a_bad_pair_stops_the_stream_and_says_how_far_it_got(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    expected = copy.deepcopy(model)  # the old weights, but layer 1's
    good = [(name, t) for name, t in fresh.state_dict().items() if name.startswith("1.")]
    expected[1].load_state_dict({name.removeprefix("1."): t for name, t in good})
    off, _ = offloaded(kind, model)
    with pytest.raises(ExecutionError, match=rf"{len(good)} tensors were written before it") as info:
        off.load_weights([*good, ("2.mlp.up.weight", torch.zeros(3))])
    assert info.value.name == "2.mlp.up.weight"
    x = next(activations(10, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), expected(x))  # the model computes with what was written
    off.restore()
    assert same_state(model, expected)


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_refused_inside_a_capture_after_restore_and_before_wrapping(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1).state_dict()
    runtime = FakeRuntime()
    off = create_offloader(KINDS[kind](model), runtime)
    with pytest.raises(ExecutionError, match=r"needs a wrapped model \(state new\)"):
        off.load_weights(fresh)
    off.wrap_modules(layer_list(model))
    off.post_init()
    runtime.capturing = True
    with pytest.raises(ExecutionError, match="inside a CUDA graph capture") as info:
        off.load_weights(fresh)
    assert info.value.name == "capturing"
    runtime.capturing = False
    off.restore()
    with pytest.raises(ExecutionError, match=r"needs a wrapped model \(state restored\)"):
        off.load_weights(fresh)


# ---- with the rest of the lifecycle --------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "uva", "on-demand-pinned"])
def test_before_post_init_the_loader_can_use_it_too(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    off = create_offloader(KINDS[kind](model), FakeRuntime())
    off.wrap_modules(layer_list(model))
    off.load_weights(fresh.state_dict())
    off.post_init()
    x = next(activations(7, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    off.restore()
    assert same_state(model, fresh)


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "prefetch-lone-owners"])
def test_load_weights_after_a_refused_write_in_place_runs_again(kind: str) -> None:
    model = transformer_model(4)
    fresh = transformer_model(4, seed=1)
    off, _ = offloaded(kind, model)
    with torch.no_grad():  # into the slots, around load_weights: refused at the next forward
        for name, p in model.named_parameters():
            p.copy_(fresh.get_parameter(name))
    x = next(activations(8, "mixed"))
    with pytest.raises(ExecutionError, match="written in place"):
        with torch.no_grad():
            model(x)
    off.load_weights(fresh.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
        assert torch.equal(model(x), fresh(x))
    assert off.stats().realignments == 0  # the reload began a step afresh: no layer ran without its weights
    off.restore()


def test_a_prefetch_reload_refills_the_slots_before_a_graph_replay() -> None:
    """A CUDA graph replay runs no Python: the first copies of a step come from the
    previous replay's end, or from load_weights, which issues them afresh; after
    sync_prev_onload they hold the new weights."""
    model = transformer_model(4)
    fresh = transformer_model(4, seed=1)
    off, runtime = offloaded("prefetch-pinned", model)
    x = next(activations(9, "mixed"))
    with torch.no_grad():
        model(x)
    off.load_weights(fresh.state_dict())
    off.sync_prev_onload()
    plan = off.plan
    first = plan.offloaded_layers[0]
    slot_param = layer_list(model)[first].get_parameter("mlp.up.weight")
    assert torch.equal(slot_param, fresh.get_parameter(f"{first}.mlp.up.weight"))
    off.restore()


# ---- load_state_dict, routed -------------------------------------------------------------


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_load_state_dict_of_the_model_is_routed_into_the_host_copies(kind: str, model_name: str) -> None:
    model = MODELS[model_name](0)
    fresh = MODELS[model_name](1)
    off, runtime = offloaded(kind, model)
    with torch.no_grad():
        for x in activations(2, model_name):
            model(x)
    logged = len(runtime.log)
    result = model.load_state_dict(fresh.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert not [e for e in runtime.log[logged:] if isinstance(e, (HostCopy, HostEmpty))]
    with torch.no_grad():
        for x in activations(3, model_name):
            assert torch.equal(model(x), fresh(x))
    assert off.stats().realignments == 0  # refilling the slots is not a realignment
    assert same_state(model, fresh)
    off.restore()
    assert same_state(model, fresh)


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "uva", "on-demand-pinned"])
def test_load_state_dict_of_one_layer_or_a_part_of_one_is_routed_too(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    off, _ = offloaded(kind, model)
    model[1].load_state_dict(fresh[1].state_dict())
    model[2].get_submodule("mlp").load_state_dict(fresh[2].get_submodule("mlp").state_dict())
    expected = copy.deepcopy(transformer_model(3))
    expected[1].load_state_dict(fresh[1].state_dict())
    expected[2].get_submodule("mlp").load_state_dict(fresh[2].get_submodule("mlp").state_dict())
    x = next(activations(11, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), expected(x))
    off.restore()
    assert same_state(model, expected)


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "uva"])
def test_a_strict_load_state_dict_that_fails_still_leaves_the_model_consistent(kind: str) -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    off, _ = offloaded(kind, model)
    partial = {k: v for k, v in fresh.state_dict().items() if not k.startswith("2.")}
    with pytest.raises(RuntimeError, match="Missing key"):  # torch's own strict check, as without offloading
        model.load_state_dict(partial)
    expected = transformer_model(3)
    expected.load_state_dict(partial, strict=False)  # what torch wrote before raising
    x = next(activations(12, "mixed"))
    with torch.no_grad():
        assert torch.equal(model(x), expected(x))
    off.restore()
    assert same_state(model, expected)


def test_a_graph_replay_after_load_state_dict_reads_the_new_weights_once_synced() -> None:
    model = transformer_model(4)
    fresh = transformer_model(4, seed=1)
    off, _ = offloaded("prefetch-pinned", model)
    with torch.no_grad():
        model(next(activations(13, "mixed")))
    model.load_state_dict(fresh.state_dict())
    off.sync_prev_onload()  # before a replay: the step's first slots are refilled
    first = off.plan.offloaded_layers[0]
    slot = layer_list(model)[first].get_parameter("mlp.up.weight")
    assert torch.equal(slot, fresh.get_parameter(f"{first}.mlp.up.weight"))
    off.restore()


def test_load_state_dict_with_assign_gives_new_parameters_which_are_refused_then_kept() -> None:
    model = transformer_model(3)
    fresh = transformer_model(3, seed=1)
    off, _ = offloaded("prefetch", model)
    model.load_state_dict(fresh.state_dict(), assign=True)
    with pytest.raises(ExecutionError, match="replaced by a new Parameter"):
        with torch.no_grad():
            model(next(activations(14, "mixed")))
    off.restore()
    assert same_state(model, fresh)
