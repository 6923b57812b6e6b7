"""`offload.graphs.captured`: the capture protocol, on the CPU with a runtime that plays a
CUDA graph capture, including captures that are aborted."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from offload import OffloadConfig
from offload.executors import PrefetchOffloader
from offload.graphs import captured
from tests.executors.fakes import FakeRuntime, Sync, Wait
from tests.executors.helpers import cuda_like_plan, inputs, prefetch
from tests.executors.models import TransformerBlock, layer_list, transformer_model

NUM_LAYERS = 5


class Aborted(RuntimeError):
    """What the tests raise inside a capture."""


@contextmanager
def playing_capture(runtime: FakeRuntime) -> Iterator[None]:
    """A capture as the fake runtime plays it: `is_capturing` is True inside."""
    runtime.capturing = True
    try:
        yield
    finally:
        runtime.capturing = False


class FailingBlock(TransformerBlock):
    """A block that raises while `fail` is set (after its wait, before its start)."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise Aborted("layer failed inside the capture")
        return super().forward(x)


def setup(model: nn.Sequential) -> tuple[FakeRuntime, PrefetchOffloader]:
    """Deferred copies (a copy lands only when waited for or synchronised), pinned plan
    (capturable), warmed up by two eager forwards, as capture_forward does."""
    runtime = FakeRuntime(defer=True)
    off = prefetch(cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False),
                   runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    with torch.no_grad():
        for x in inputs(seed=40, shapes=((2, 5), (2, 5))):
            model(x)
    return runtime, off


def test_captured_follows_the_protocol() -> None:
    model = transformer_model(NUM_LAYERS)
    reference = copy.deepcopy(model)
    runtime, offloader = setup(model)
    x = next(inputs(seed=41))
    start = len(runtime.log)
    with torch.no_grad():
        out = captured(lambda: model(x), offloader, playing_capture(runtime))
    assert torch.equal(out, reference(x))
    log = runtime.log[start:]
    assert log[0] == Sync()
    # Everything after the sync happened inside the played capture; the join's waits last.
    assert all(e.capturing for e in log if isinstance(e, Wait))
    assert Sync() not in log[1:]


@pytest.mark.parametrize("where", ["after-the-forward", "mid-forward"])
def test_an_aborted_capture_leaves_the_next_eager_forward_exact(where: str) -> None:
    """Before the fix, after a capture aborted once the forward had run (here: in the code
    between the forward and the join), the next eager forward skipped the waits of the
    copies issued in the capture and layer 0 read the slot's last owner (layer 4)."""
    torch.manual_seed(0)
    blocks = [FailingBlock() for _ in range(NUM_LAYERS)]
    model = nn.Sequential(*blocks)
    reference = copy.deepcopy(model)
    runtime, offloader = setup(model)
    x = next(inputs(seed=42))

    def run() -> torch.Tensor:
        if where == "mid-forward":
            blocks[2].fail = True
        model(x)
        raise Aborted("failed after the forward, before the join")

    with torch.no_grad(), pytest.raises(Aborted):
        captured(run, offloader, playing_capture(runtime))
    blocks[2].fail = False
    assert not runtime.capturing
    with torch.no_grad():
        for y in inputs(seed=43, shapes=((2, 5), (1, 3), (2, 5))):
            assert torch.equal(model(y), reference(y))
    # And a capture after the aborted one works.
    with torch.no_grad():
        y = next(inputs(seed=44))
        assert torch.equal(captured(lambda: model(y), offloader, playing_capture(runtime)), reference(y))
        z = next(inputs(seed=45))
        assert torch.equal(model(z), reference(z))
    offloader.restore()


def test_a_failing_recovery_sync_does_not_hide_the_capture_failure() -> None:
    class BrokenSync:
        calls = 0

        def sync_prev_onload(self) -> None:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("device lost")

        def join_after_forward(self) -> None:
            raise AssertionError("not reached")

    broken = BrokenSync()

    def run() -> None:
        raise Aborted("capture failed")

    with pytest.raises(Aborted):
        captured(run, broken, playing_capture(FakeRuntime()))  # type: ignore[arg-type]  # a partial offloader
    assert broken.calls == 2
