"""The on-demand path under torch.compile: the per-call copies are one custom op per layer
(`offload::copy_on_demand`), so dynamo traces the whole forward (no graph break, and
``fullgraph=True`` works), the copies still run once per call and are counted, and they
are freed layer by layer (not all alive at once).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import assert_restored, inputs, snapshot, uva
from tests.executors.models import TiedBlock, layer_list, mixed_model, transformer_model
from tests.executors.uva_helpers import copied_per_layer, copies_per_forward, cross_layer_tied_model, on_demand_plan

SHAPES = ((2, 5), (2, 5), (2, 5))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tied_within() -> nn.Module:
    return nn.Sequential(TiedBlock(), TiedBlock())


@pytest.mark.parametrize("build", [
    pytest.param(functools.partial(transformer_model, 5), id="transformer"),
    pytest.param(cross_layer_tied_model, id="cross-layer-ties"),
    pytest.param(_tied_within, id="tied-within"),
])
def test_fullgraph_aot_eager_parity_and_copies_counted(build: Callable[[], nn.Module]) -> None:
    model = build()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    plan = on_demand_plan(model)
    off = uva(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    copies, nbytes = copies_per_forward(plan)
    for forwards, x in enumerate(inputs(seed=3, shapes=SHAPES), start=1):
        assert torch.equal(compiled(x), reference(x))
        # The op ran on every call (it was not traced away or constant-folded).
        stats = off.stats()
        assert (stats.copies_issued, stats.bytes_copied) == (forwards * copies, forwards * nbytes)
    off.restore()
    assert_restored(model, before, same_storage=False)


def test_no_graph_break_where_the_resident_model_has_none() -> None:
    model = transformer_model(4)
    x = next(inputs(seed=5, shapes=SHAPES))
    assert torch._dynamo.explain(copy.deepcopy(model))(x).graph_break_count == 0
    off = uva(on_demand_plan(model))
    off.wrap_modules(layer_list(model))
    off.post_init()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1


# Importing inductor reaches torch.jit.script(_method), deprecated since torch 2.10.
@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script:FutureWarning")
def test_inductor_fullgraph_close_and_copies_freed_layer_by_layer() -> None:
    """Inductor fuses differently from eager (a tolerance); the copies of a layer are
    dead after it, so at most two layers' copies are ever alive on the (played) device."""
    model = mixed_model()
    reference = copy.deepcopy(model)
    plan = on_demand_plan(model)
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    per_layer = {layer: nbytes for layer, (_, nbytes) in copied_per_layer(plan).items()}
    assert len(per_layer) >= 4
    compiled = torch.compile(model, fullgraph=True)
    for x in inputs(seed=6, shapes=((1, 3), (1, 3))):
        runtime.device_peak_bytes = runtime.device_live_bytes
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
        two_largest = sum(sorted(per_layer.values())[-2:])
        assert 0 < runtime.device_peak_bytes <= two_largest
    assert off.stats().copies_issued == 2 * copies_per_forward(plan)[0]
