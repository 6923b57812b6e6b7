"""The order of copies, events, waits and compute, read from a recording fake runtime;
and the CUDA-graph logic, with a fake whose capture state the test toggles.

Stream model used to judge the log (what CUDA guarantees): the copy stream runs its copies
in issue order, and a copy issued with ``after=None`` comes after every earlier wait of
the copy stream, so the event that orders a copy is the latest ``after`` given to that
copy or to one before it. A wait for a copy's done event also covers every copy issued
before it on the copy stream.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan
from offload.executors import PrefetchOffloader
from tests.executors.fakes import Copy, Entry, FakeEvent, FakeRuntime, Read, Record, Sync, Wait
from tests.executors.helpers import cpu_plan, cuda_like_plan, inputs, prefetch
from tests.executors.models import ProbeBlock, layer_list, transformer_model

ORDER_CONFIGS = [
    pytest.param(5, OffloadConfig(group_size=1), id="5-layers-step1"),
    pytest.param(5, OffloadConfig(group_size=1, prefetch_step=2), id="5-layers-step2"),
    pytest.param(5, OffloadConfig(group_size=1, prefetch_step=3), id="5-layers-step3"),
    pytest.param(6, OffloadConfig(group_size=2, prefetch_step=2), id="every-2nd-of-6-step2"),
    pytest.param(4, OffloadConfig(group_size=1, prefetch_step=4), id="4-layers-step4"),
]


def probe_model(num_layers: int, runtime: FakeRuntime) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[ProbeBlock(str(i), runtime.read) for i in range(num_layers)])


def effective_after(log: list[Entry]) -> dict[int, FakeEvent]:
    """For each Copy's log index, the compute event that orders it (stream model above)."""
    out: dict[int, FakeEvent] = {}
    current: FakeEvent | None = None
    for index, entry in enumerate(log):
        if isinstance(entry, Copy):
            if entry.after is not None:
                current = entry.after
            assert current is not None, f"copy at {index} is ordered after nothing"
            out[index] = current
    return out


def check_order(log: list[Entry]) -> tuple[int, int]:
    """Assert both rules on a log; return how many copies and buffer reads were checked."""
    recorded_at = {entry.event: i for i, entry in enumerate(log) if isinstance(entry, Record)}
    copy_at = {entry.done: i for i, entry in enumerate(log) if isinstance(entry, Copy)}
    buffers = {entry.dst for entry in log if isinstance(entry, Copy)}
    ordering = effective_after(log)

    # 1. A copy into a buffer is issued after an event recorded on the compute stream after
    #    the last compute that read that buffer.
    last_read: dict[int, int] = {}
    copies = 0
    for index, entry in enumerate(log):
        if isinstance(entry, Read):
            last_read[entry.ptr] = index
        elif isinstance(entry, Copy):
            event = ordering[index]
            assert event in recorded_at, f"copy at {index} ordered by {event}, not a compute event"
            assert recorded_at[event] > last_read.get(entry.dst, -1), (
                f"copy at {index} into {entry.dst:#x} is ordered by an event recorded at "
                f"{recorded_at[event]}, before the read at {last_read[entry.dst]}")
            copies += 1

    # 2. Compute reads a buffer only after waiting for a done event that covers the
    #    buffer's latest copy.
    last_copy: dict[int, int] = {}
    waited: list[tuple[int, int]] = []  # (log index of the wait, log index of the copy it covers up to)
    reads = 0
    for index, entry in enumerate(log):
        if isinstance(entry, Copy):
            last_copy[entry.dst] = index
        elif isinstance(entry, Wait):
            waited.append((index, copy_at[entry.event]))
        elif isinstance(entry, Read) and entry.ptr in buffers:
            c = last_copy.get(entry.ptr)
            assert c is not None, f"read at {index} of buffer {entry.ptr:#x} before any copy into it"
            assert any(c < w < index and covered >= c for w, covered in waited), (
                f"read at {index} of {entry.name} without waiting for the copy at {c}")
            reads += 1
    return copies, reads


@pytest.mark.parametrize(("num_layers", "config"), ORDER_CONFIGS)
def test_every_copy_waits_for_the_last_read_of_its_buffer_and_every_read_for_its_copy(
    num_layers: int, config: OffloadConfig
) -> None:
    runtime = FakeRuntime()
    model = probe_model(num_layers, runtime)
    plan = cpu_plan(model, config)
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    forwards = 3
    for x in inputs(seed=30, shapes=((2, 3),) * forwards):
        model(x)
    copies, reads = check_order(runtime.log)
    # The check saw every copy and every read of an offloaded weight (it is not vacuous).
    params_per_layer = 3
    assert copies == off.stats().copies_issued
    assert reads == forwards * len(plan.offloaded_layers) * params_per_layer


def test_the_order_check_catches_a_copy_issued_before_the_read() -> None:
    """The checker itself: a log where a copy overwrites a buffer still being read fails."""
    e0, e1, done = FakeEvent(0, False), FakeEvent(1, False), FakeEvent(2, False)
    bad: list[Entry] = [Record(e0), Copy(dst=1, nbytes=4, after=e0, done=done, capturing=False),
                        Wait(done, False), Read("w", 1), Copy(dst=1, nbytes=4, after=e0,
                                                              done=FakeEvent(3, False), capturing=False)]
    with pytest.raises(AssertionError, match="before the read"):
        check_order(bad)
    unwaited: list[Entry] = [Record(e1), Copy(dst=1, nbytes=4, after=e1, done=done, capturing=False), Read("w", 1)]
    with pytest.raises(AssertionError, match="without waiting"):
        check_order(unwaited)


@pytest.mark.parametrize(("num_layers", "config"), ORDER_CONFIGS)
def test_parity_when_copies_finish_as_late_as_a_stream_may(num_layers: int, config: OffloadConfig) -> None:
    """Deferred copies run only when waited for: any read without its wait would see the
    previous owner's weights."""
    model = transformer_model(num_layers)
    reference = copy.deepcopy(model)
    runtime = FakeRuntime(defer=True)
    off = prefetch(cpu_plan(model, config), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=31):
        assert torch.equal(model(x), reference(x))


# ---- CUDA graphs --------------------------------------------------------------------------


def warmed_up(plan: OffloadPlan, num_layers: int) -> tuple[FakeRuntime, PrefetchOffloader, nn.Sequential, nn.Sequential]:
    """A model wrapped and post_init'ed, with one eager forward done (as before a capture)."""
    runtime = FakeRuntime()
    model = transformer_model(num_layers)
    reference = copy.deepcopy(model)
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=32)))
    return runtime, off, model, reference


@pytest.mark.parametrize("disable_pin_memory", [None, True], ids=["cpu-plan", "cuda-plan-pin-disabled"])
def test_capture_with_pinning_off_raises_before_any_copy(disable_pin_memory: bool | None) -> None:
    config = OffloadConfig(group_size=1, prefetch_step=2)
    model = transformer_model(4)
    if disable_pin_memory is None:
        plan = cpu_plan(model, config)
    else:
        plan = cuda_like_plan(model, config, disable_pin_memory=True)
    assert not plan.pin.pin
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=33)))
    off.sync_prev_onload()
    runtime.capturing = True
    with pytest.raises(ExecutionError, match="pinning is off") as info:
        model(next(inputs(seed=34)))
    assert info.value.name == "pin"
    assert "CUDA graph" in str(info.value)
    if disable_pin_memory:
        assert "OFFLOAD_DISABLE_PIN_MEMORY" in str(info.value)  # says how to fix it
    assert [e for e in runtime.entries(Copy) if e.capturing] == []
    assert [e for e in runtime.entries(Wait) if e.capturing] == []


CAPTURE_CONFIGS = [
    pytest.param(5, OffloadConfig(group_size=1, prefetch_step=2), id="5-layers-step2"),
    pytest.param(5, OffloadConfig(group_size=1, prefetch_step=1), id="5-layers-step1"),
    pytest.param(3, OffloadConfig(group_size=1, prefetch_step=2), id="3-layers-step2"),
    pytest.param(6, OffloadConfig(group_size=2, prefetch_step=2), id="every-2nd-of-6-step2"),
    pytest.param(3, OffloadConfig(group_size=1, prefetch_step=3), id="3-layers-step3"),
]


def group_done_events(copies: list[Copy]) -> list[FakeEvent]:
    """The done event of each issue (a copy with ``after`` starts one; the last copy's
    done event ends it), in order."""
    done: list[FakeEvent] = []
    for entry in copies:
        if entry.after is not None:
            done.append(entry.done)
        else:
            done[-1] = entry.done
    return done


@pytest.mark.parametrize(("num_layers", "config"), CAPTURE_CONFIGS)
def test_capture_skips_waits_for_earlier_copies_and_joins_its_own(num_layers: int, config: OffloadConfig) -> None:
    model0 = transformer_model(num_layers)
    plan = cuda_like_plan(model0, config, disable_pin_memory=False)
    assert plan.pin.pin
    runtime, off, model, reference = warmed_up(plan, num_layers)
    off_log_start = len(runtime.log)
    steps = min(config.prefetch_step, len(plan.offloaded_layers))

    # sync_prev_onload makes the copies issued so far complete.
    off.sync_prev_onload()
    assert runtime.log[off_log_start:] == [Sync()]

    runtime.capturing = True
    before_forward = len(runtime.log)
    x = next(inputs(seed=35))
    assert torch.equal(model(x), reference(x))
    before_join = len(runtime.log)
    off.join_after_forward()
    after_join = len(runtime.log)
    runtime.capturing = False

    forward_log = runtime.log[before_forward:before_join]
    join_log = runtime.log[before_join:after_join]
    forward_waits = [e.event for e in forward_log if isinstance(e, Wait)]
    join_waits = [e.event for e in join_log if isinstance(e, Wait)]
    assert all(isinstance(e, Wait) for e in join_log)
    issued_in_capture = group_done_events([e for e in forward_log if isinstance(e, Copy)])
    assert all(e.capturing for e in forward_log if isinstance(e, Copy))
    # One issue after each layer, but for lone owners of a slot (slot i is owned by
    # positions i, i + steps, ...): they stay loaded, and nothing is copied for them again.
    n = len(plan.offloaded_layers)
    lone = [i for i in range(steps) if i + steps >= n]
    assert len(issued_in_capture) == n - len(lone)

    # Copies issued before the capture are not waited on inside it.
    assert all(event.capturing for event in forward_waits + join_waits)
    # The first `steps` positions were prefetched before the capture: their waits were skipped.
    assert len(forward_waits) == len(plan.offloaded_layers) - steps
    # Each copy issued in the capture is waited on: by its layer, or by the join.
    assert set(forward_waits) <= set(issued_in_capture)
    # The join waits exactly for those still outstanding: the wrap-around prefetches.
    outstanding = [e for e in issued_in_capture if e not in forward_waits]
    assert sorted(join_waits, key=lambda e: e.number) == outstanding  # each once, in any order
    assert len(join_waits) == steps - len(lone)

    # Outside a capture there is nothing of that kind to join.
    off.join_after_forward()
    assert len(runtime.log) == after_join


def test_sync_prev_onload_synchronizes_and_join_outside_capture_waits_for_nothing() -> None:
    model = transformer_model(3)
    runtime = FakeRuntime()
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=36)))
    start = len(runtime.log)
    off.sync_prev_onload()
    off.join_after_forward()
    assert runtime.log[start:] == [Sync()]


def test_after_a_capture_eager_forwards_and_another_capture_keep_working() -> None:
    """The executor's per-position state survives crossing capture boundaries both ways."""
    model0 = transformer_model(5)
    plan = cuda_like_plan(model0, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False)
    runtime, off, model, reference = warmed_up(plan, 5)
    xs = list(inputs(seed=37, shapes=((2, 5),) * 6))
    for round_ in range(2):
        off.sync_prev_onload()
        runtime.capturing = True
        assert torch.equal(model(xs[3 * round_]), reference(xs[3 * round_]))
        off.join_after_forward()
        runtime.capturing = False
        for x in xs[3 * round_ + 1: 3 * round_ + 3]:
            assert torch.equal(model(x), reference(x))
    assert all(e.event.capturing == e.capturing for e in runtime.entries(Wait))  # never across a boundary


@pytest.mark.parametrize("stop_after", [1, 3])
def test_sync_prev_onload_after_a_forward_that_stopped_part_way_refills_the_first_slots(stop_after: int) -> None:
    """A CUDA graph replay begins a step with the first positions' slots as they are (a
    replay refills them only at its end): after an eager forward that stopped part way,
    they hold later layers' weights, so sync_prev_onload issues the step's first copies
    afresh (found in a review of the CUDA paths)."""
    model = transformer_model(5)
    reference = copy.deepcopy(model)
    runtime = FakeRuntime()
    off = prefetch(cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False),
                   runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    off.post_init()
    x = next(inputs(seed=37))
    model(x)
    for layer in layers[:stop_after + 1]:  # a forward that stops after layer `stop_after`
        x = layer(x)
    off.sync_prev_onload()
    for position in off.plan.schedule.initial:
        index = off.plan.offloaded_layers[position]
        slot = layers[index].get_parameter("mlp.up.weight")
        assert torch.equal(slot, reference[index].get_parameter("mlp.up.weight")), index
    assert torch.equal(model(x), reference(x))  # and the next eager step is exact
