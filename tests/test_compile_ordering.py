"""torch.compile orders every read of a weight buffer by construction.

The prefetch ops declare the slot tensors they fill (the wait) and overwrite (the start)
as mutated, so the compiler sees each weight written by the op before it. These tests
make the compiler's choice adversarial: inductor's BFS topological sort forced as an extra
scheduling pass (`reorder_for_compute_comm_overlap_passes`), which, were the weights not
declared, hoists the weight-only int8 dequantisation of every layer above every wait; and
a `FakeRuntime` that defers each copy until it is waited for, so a read that overtakes
its wait sees the slot's previous owner.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch._inductor.memory import topological_sort_bfs

from offload import OffloadConfig
from offload.executors import ops
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, inputs, prefetch
from tests.executors.models import Int8Linear, layer_list, transformer_model

# Importing inductor reaches torch.jit.script(_method), deprecated since torch 2.10 (the
# category changed between releases: match the message only).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script")

COPIES_HANDED = "handed the prefetch ops copies"


def _int8_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Int8Linear() for _ in range(6)]).requires_grad_(False)


def test_forced_bfs_schedule_keeps_weight_only_math_after_each_wait(caplog: pytest.LogCaptureFixture) -> None:
    """Before the fix the outputs were off by more than 1 (every layer dequantised another
    layer's int8 weights); now they match, and inductor re-inplaces the ops (they get the
    buffers themselves, no copies)."""
    caplog.set_level(logging.INFO, logger="offload.compile")
    torch._dynamo.reset()
    model = _int8_model()
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), FakeRuntime(defer=True))
    off.wrap_modules(layer_list(model))
    off.post_init()
    try:
        with torch._inductor.config.patch(reorder_for_compute_comm_overlap=True,
                                          reorder_for_compute_comm_overlap_passes=[topological_sort_bfs]):
            compiled = torch.compile(model, fullgraph=True)
            with torch.no_grad():
                for x in inputs(seed=21, shapes=((1, 3), (1, 3))):
                    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    finally:
        off.restore()
        torch._dynamo.reset()
    assert not [r for r in caplog.records if COPIES_HANDED in r.getMessage()]


def test_aot_eager_with_deferred_copies_is_exact_and_leaves_the_buffers_right(
        caplog: pytest.LogCaptureFixture) -> None:
    """aot_eager functionalises the ops without re-inplacing them: they get copies of the
    slots and the graph writes the copies back afterwards. The ops fill the copies (the
    start lets its copy land first), so compiled forwards are exact and an eager forward
    after them still reads the right weights."""
    caplog.set_level(logging.INFO, logger="offload.compile")
    torch._dynamo.reset()
    model = transformer_model(5)
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), FakeRuntime(defer=True))
    off.wrap_modules(layer_list(model))
    off.post_init()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            for x in inputs(seed=5, shapes=((2, 5), (2, 5))):
                assert torch.equal(compiled(x), reference(x))
            for x in inputs(seed=6, shapes=((1, 3),)):
                assert torch.equal(model(x), reference(x))
    finally:
        off.restore()
        torch._dynamo.reset()
    assert [r for r in caplog.records if COPIES_HANDED in r.getMessage()]


def test_ops_declare_the_weights_mutated_and_carry_the_cudagraph_tag() -> None:
    """The schema is what the compiler orders by: the weights are written (``Tensor(a!)[]``),
    and where this torch has ``cudagraph_unsafe``, CUDA graph trees leave the ops out."""
    for op in (torch.ops.offload.wait_prefetch.default, torch.ops.offload.start_prefetch.default):
        mutated = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == {"activation", "weights"}
        tag = getattr(torch.Tag, "cudagraph_unsafe", None)
        if tag is not None:
            assert tag in op.tags
    assert ops.OPS_TAGS == ((torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ())
