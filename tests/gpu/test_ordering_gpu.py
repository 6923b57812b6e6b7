"""The GPU-path findings of the hardening review, on a real device: compiled ordering by construction
(inductor's BFS schedule forced), `torch.compile(mode="reduce-overhead")` (CUDA graph
trees leave the cudagraph_unsafe ops out), `stats()` inside a capture, and an aborted
capture followed by eager forwards.

Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.memory import topological_sort_bfs

from offload import OffloadConfig
from offload.graphs import capture_forward
from tests.gpu.test_prefetch_gpu import check_int8_compiled_parity, gpu_inputs, gpu_model, offload, plan_for

pytestmark = [
    # By message only: the category changed between torch releases.
    pytest.mark.filterwarnings("ignore:`torch.jit.script"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use the new API settings to control TF32:UserWarning"),
]

STEP2 = OffloadConfig(group_size=1, prefetch_step=2)


class Aborted(RuntimeError):
    """Raised on purpose inside a capture."""


def test_forced_bfs_schedule_keeps_weight_only_math_after_the_wait() -> None:
    """Int8 layers of 16 MiB, one token: copies are slow next to the compute, so a
    dequantisation hoisted above its wait would read another layer's weights."""
    with torch._inductor.config.patch(reorder_for_compute_comm_overlap=True,
                                      reorder_for_compute_comm_overlap_passes=[topological_sort_bfs]):
        check_int8_compiled_parity()


def test_reduce_overhead_mode_matches_eager() -> None:
    """CUDA graph trees run the tagged ops outside their graphs (partitioned around them,
    or skipped for the graph); warm-up, recording and replays all stay exact enough."""
    torch._dynamo.reset()
    model = gpu_model(4, hidden=512)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, STEP2))
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    issued = off.stats().copies_issued
    for x in gpu_inputs(seed=30, count=6, hidden=512):
        out = compiled(x).clone()  # graph trees reuse their output memory on the next call
        torch.testing.assert_close(out, reference(x), atol=3e-2, rtol=3e-2)
    assert off.stats().copies_issued >= issued + 6 * 4  # the ops ran on every call
    for x in gpu_inputs(seed=31, count=2, hidden=512):
        assert torch.equal(model(x), reference(x))  # eager after compiled: buffers intact
    off.restore()
    torch._dynamo.reset()


def test_stats_inside_a_capture_do_not_invalidate_it() -> None:
    """The warm-up leaves timed waits to add up; before the fix `stats()` queried their
    events inside the capture (cudaErrorStreamCaptureUnsupported, capture invalidated)."""
    model = gpu_model(4)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, STEP2))
    xs = list(gpu_inputs(seed=32, count=3))
    static_x = xs[0].clone()
    seen: list[float | None] = []

    def forward_and_stats(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(x)
        seen.append(off.stats().wait_seconds)
        return out

    graph, out = capture_forward(forward_and_stats, static_x, off)
    for x in xs:
        static_x.copy_(x)
        off.sync_prev_onload()
        graph.replay()
        torch.testing.assert_close(out, reference(x), atol=2e-2, rtol=2e-2)
    assert len(seen) == 3  # two warm-ups, one captured
    torch.cuda.synchronize()
    assert (off.stats().wait_seconds or 0.0) >= (seen[-1] or 0.0)
    off.restore()


@pytest.mark.parametrize("where", ["after-the-forward", "mid-forward"])
def test_an_aborted_capture_leaves_eager_forwards_exact(where: str) -> None:
    model = gpu_model(5)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, STEP2))
    static_x = next(gpu_inputs(seed=33, count=1))
    calls = 0

    def failing(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls <= 2:  # the warm-up forwards
            return model(x)  # type: ignore[no-any-return]  # nn.Module.__call__ is untyped
        if where == "mid-forward":
            model[0](x)  # one kernel at least, so ending the capture does not warn of an empty graph
            model[1](x)
            raise Aborted("failed part way through the captured forward")
        model(x)
        raise Aborted("failed after the captured forward, before the join")

    with pytest.raises(Aborted):
        capture_forward(failing, static_x, off)
    torch.cuda.synchronize()
    for x in gpu_inputs(seed=34, count=3):
        assert torch.equal(model(x), reference(x))
    # ... and a capture after it works.
    static_y = next(gpu_inputs(seed=35, count=1))
    graph, out = capture_forward(model, static_y, off)
    graph.replay()
    torch.testing.assert_close(out, reference(static_y), atol=2e-2, rtol=2e-2)
    off.restore()
