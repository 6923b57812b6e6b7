"""Per-step telemetry: steps, per-step figures that add up to the
totals, copy time and bandwidth as the runtime measured them, `render_stats`, the opt-in
periodic log line, and named profiler ranges."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, create_offloader, render_stats
from offload.executors import PrefetchOffloader
from offload.pure.stats import OffloadStats, render_stats_line
from offload.runtime.cpu import CpuRuntime
from tests.executors.fakes import COPY_SECONDS_PER_BYTE, WAIT_SECONDS, FakeRuntime, Wait
from tests.executors.helpers import cpu_plan, inputs, pinned_plan, prefetch, uva
from tests.executors.models import layer_list, transformer_model
from tests.executors.uva_helpers import copies_per_forward, on_demand_plan

PREFETCH = OffloadConfig(group_size=1, prefetch_step=2)
FORWARDS = 5


def _shapes(n: int) -> tuple[tuple[int, int], ...]:
    return ((1, 3),) * n


def _ready(layers: int) -> tuple[nn.Module, OffloadPlan, FakeRuntime, PrefetchOffloader]:
    """A pinned prefetch plan of `layers` blocks, wrapped and post_init'ed on a fake runtime."""
    model = transformer_model(layers)
    plan = pinned_plan(model, PREFETCH)
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return model, plan, runtime, off


def test_prefetch_steps_and_per_step_figures_add_up_to_the_totals() -> None:
    model, plan, runtime, off = _ready(4)
    before = off.stats()
    assert before.steps == 0 and before.bytes_per_step is None and before.wait_seconds_per_step is None
    for x in inputs(seed=1, shapes=_shapes(FORWARDS)):
        model(x)
    after = off.stats()
    assert after.steps == FORWARDS
    # Each step copies every offloaded layer once (post_init issued the first copies).
    assert after.bytes_copied - before.bytes_copied == FORWARDS * plan.offloaded_bytes
    assert after.bytes_per_step == after.bytes_copied / FORWARDS
    waits = sum(1 for e in runtime.log if isinstance(e, Wait) and not e.capturing)
    assert waits == FORWARDS * len(plan.offloaded_layers)
    assert after.wait_seconds_per_step == pytest.approx(WAIT_SECONDS * waits / FORWARDS)
    # The copy time is what the runtime measured; nothing was captured, so every byte is timed.
    assert after.timed_bytes == after.bytes_copied
    assert after.copy_seconds == pytest.approx(COPY_SECONDS_PER_BYTE * after.bytes_copied)
    assert after.copy_gbps == pytest.approx(1.0)
    off.restore()


def test_copies_issued_inside_a_capture_are_not_timed() -> None:
    model, _, runtime, off = _ready(3)
    x = next(inputs(seed=2, shapes=_shapes(1)))
    model(x)
    eager = off.stats()
    off.sync_prev_onload()
    runtime.capturing = True
    model(x)
    off.join_after_forward()
    runtime.capturing = False
    captured = off.stats()
    assert captured.bytes_copied > eager.bytes_copied  # the capture issued copies ...
    assert captured.timed_bytes == eager.timed_bytes  # ... which the runtime does not time
    assert captured.copy_seconds == pytest.approx(eager.copy_seconds)
    off.restore()


def test_the_cpu_runtime_times_its_copies() -> None:
    model = transformer_model(3)
    off = create_offloader(cpu_plan(model, PREFETCH), CpuRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=3, shapes=_shapes(3)):
        model(x)
    stats = off.stats()
    assert stats.steps == 3
    assert stats.copy_seconds is not None and stats.copy_seconds > 0
    assert stats.copy_gbps is not None and math.isfinite(stats.copy_gbps) and stats.copy_gbps > 0
    off.restore()


def test_on_demand_steps_count_runs_of_the_first_on_demand_layer() -> None:
    model = transformer_model(3)
    plan = on_demand_plan(model)
    off = uva(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=4, shapes=_shapes(FORWARDS)):
        model(x)
    stats = off.stats()
    copies, nbytes = copies_per_forward(plan)
    assert stats.steps == FORWARDS
    assert stats.bytes_per_step == nbytes
    assert (stats.copy_seconds, stats.copy_gbps) == (None, None)  # on the compute stream: not timed
    assert "copy bandwidth" in render_stats(stats) and "not measured" in render_stats(stats)
    off.restore()


def test_render_stats_shows_each_figure_and_the_ratio_to_the_link() -> None:
    stats = OffloadStats(steps=4, copies_issued=8, bytes_copied=4 << 30, wait_seconds=0.002,
                         copy_seconds=2.0, timed_bytes=4 << 30, params_offloaded=16, realignments=1)
    text = render_stats(stats, link_gbps=4 * 2**30 / 2.0 / 1e9)
    lines = dict(line.split("  ", 1) for line in text.splitlines())
    assert lines["steps"].strip() == "4"
    assert lines["copied per step"].strip() == "1.000 GiB"
    assert lines["compute waited"].strip() == "2.000 ms (0.500 ms per step)"
    assert lines["copy bandwidth"].strip().startswith(f"{4 * 2**30 / 2.0 / 1e9:.2f} GB/s (1.00x the link's")
    assert lines["realignments"].strip() == "1"
    assert "link" not in render_stats(stats)
    empty = render_stats(OffloadStats())
    assert "n/a (no step yet)" in empty and "not measured" in empty
    assert render_stats_line(stats).startswith("offload: step 4, 1.000 GiB copied per step, 0.500 ms waited per step")


def test_log_stats_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    model, _, _, off = _ready(3)
    off.log_stats_every(steps=2)
    with caplog.at_level(logging.INFO, logger="offload.stats"):
        for x in inputs(seed=5, shapes=_shapes(FORWARDS)):
            model(x)
        off.log_stats_every()  # off again
        model(next(inputs(seed=6, shapes=_shapes(1))))
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.stats"]
    assert [line.split(",")[0] for line in lines] == ["offload: step 2", "offload: step 4"]
    off.restore()


def test_each_stats_line_reports_finished_steps_on_demand(caplog: pytest.LogCaptureFixture) -> None:
    """The line is written when a step's copies are all counted (it was
    written when a step began, and said 0, then half, then two thirds of the bytes a step
    copies)."""
    model = transformer_model(3)
    plan = on_demand_plan(model)
    off = uva(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    _, nbytes = copies_per_forward(plan)
    off.log_stats_every(steps=1)
    with caplog.at_level(logging.INFO, logger="offload.stats"):
        for x in inputs(seed=7, shapes=_shapes(3)):
            model(x)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.stats"]
    per_step = f"{nbytes / 2**20:.3f} MiB copied per step"  # the test models are small
    assert [line.split(", ")[:2] for line in lines] == [[f"offload: step {n}", per_step] for n in (1, 2, 3)]
    off.restore()


def test_each_stats_line_reports_finished_steps_prefetch(caplog: pytest.LogCaptureFixture) -> None:
    """Prefetch writes the line when the next step begins (the hot path pays nothing more),
    about the steps finished then."""
    model, plan, _, off = _ready(4)
    off.log_stats_every(steps=1)
    with caplog.at_level(logging.INFO, logger="offload.stats"):
        for x in inputs(seed=8, shapes=_shapes(4)):
            model(x)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.stats"]
    assert [line.split(",")[0] for line in lines] == ["offload: step 1", "offload: step 2", "offload: step 3"]
    # By the end of step k, the first copies (post_init's) and each step's copies were
    # issued: the line's figure is that total over k steps.
    owned = sum(p.nbytes for p in plan.offloaded_params if p.tied_to is None)
    first = sum(p.nbytes for p in plan.offloaded_params if p.tied_to is None
                and p.layer in {plan.offloaded_layers[i] for i in plan.schedule.initial})
    for k, line in enumerate(lines, start=1):
        assert f"{(first + k * owned) / k / 2**20:.3f} MiB copied per step" in line
    off.restore()


@pytest.mark.parametrize(("steps", "seconds", "bad"), [
    (0, None, "steps"), (-1, None, "steps"), (True, None, "steps"), (1.5, None, "steps"),
    (None, 0.0, "seconds"), (None, float("nan"), "seconds"), (None, float("inf"), "seconds"),
])
def test_log_stats_every_refuses_bad_values_by_name(steps: object, seconds: object, bad: str) -> None:
    model = transformer_model(2)
    off = prefetch(pinned_plan(model, PREFETCH), FakeRuntime())
    with pytest.raises(ExecutionError, match=bad) as info:
        off.log_stats_every(steps=steps, seconds=seconds)  # type: ignore[arg-type]
    assert info.value.name == bad


@pytest.mark.parametrize("kind", ["prefetch", "on-demand"])
def test_profiler_shows_named_ranges(kind: str) -> None:
    model = transformer_model(2)
    if kind == "prefetch":
        off: object = prefetch(pinned_plan(model, PREFETCH), FakeRuntime())
        expected = {"offload.wait layer 0", "offload.copy after layer 0", "offload.wait layer 1"}
    else:
        off = uva(on_demand_plan(model))
        expected = {"offload.copy on demand layer 0", "offload.copy on demand layer 1"}
    off.wrap_modules(layer_list(model))  # type: ignore[attr-defined]
    off.post_init()  # type: ignore[attr-defined]
    x = next(inputs(seed=7, shapes=_shapes(1)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    names = {event.key for event in prof.key_averages()}
    assert expected <= names, sorted(n for n in names if n.startswith("offload"))
    model(x)  # outside the profiler: no range, and the forward still works
    off.restore()  # type: ignore[attr-defined]
