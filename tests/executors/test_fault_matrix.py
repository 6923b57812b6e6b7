"""The fault-injection matrix: a runtime that raises on the k-th call of one of
its methods, for every k, in every phase of the lifecycle (``wrap_modules``, ``post_init``,
a forward, ``restore``), for every backend, on this machine's CPU plans and on CUDA-like
plans run on a played CUDA device (`FakeRuntime(device="cuda:0")`, so the GPU paths run:
copies to the device, page-locked host copies, zero-copy views), with four kinds of
error: an `ExecutionError`, a foreign `RuntimeError`, a `MemoryError`, a `KeyboardInterrupt`.

After each fault:

- the error that comes out is an `OffloadError` (a foreign one is its ``__cause__``), or
  the `KeyboardInterrupt` itself;
- a failed ``wrap_modules`` leaves the model bit-identical to before (values, dtypes,
  devices, strides, the same Parameter objects, the same storage sharing), with no
  instance ``forward``, hook or offload mark left on any module;
- a failed ``post_init`` leaves the model wrapped, from where ``post_init`` again (the
  fault gone) or ``restore`` succeeds, and the model then computes bit for bit as a
  resident deep copy does, or is given back bit for bit;
- a failed forward is followed by forwards (the fault gone) that give the resident
  result bit for bit, and a restore that works;
- a failed ``restore`` finishes when called again, every weight then bit-identical to
  what it was before wrapping, or, where the test replaced a weight's data between
  ``wrap_modules`` and ``post_init`` (the ``edited`` cases, as a loader or post-processing
  does), to its new data.

How many calls each phase makes of each method is counted in a dry run at collection
time; each (setup, phase, method, k, kind) is its own test id, so a failure names it. k is
exhaustive up to `EVERY_K` calls and strided beyond (see `fault_points`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadError, OffloadPlan, create_offloader
from offload.protocols import Offloader
from offload.pure.decide.pinning import PinMethod
from tests.executors.fakes import FakeRuntime, HostCopy, HostEmpty, Release
from tests.executors.faults import FAULTABLE, KINDS_OF_ERROR, FaultyRuntime, make_error
from tests.executors.helpers import ParamState, snapshot
from tests.executors.models import HIDDEN, TiedBlock, TransformerBlock, bits, layer_list
from tests.executors.moves_helpers import cpu_plan_for, gpu_plan

#: The phases of the lifecycle a fault is armed for, in order.
PHASES = ("wrap", "post_init", "forward", "restore")

#: Platforms: this machine (no accelerator), and a CUDA-like plan with pinning on, run on
#: the played CUDA device. On the CPU a uva plan is an on-demand plan (no views), so it is
#: tested once, as on_demand.
BACKENDS = {
    "cpu": ("prefetch", "on_demand", "none"),
    "cuda-pin": ("prefetch", "uva", "on_demand", "none"),
}

#: Every k below this is tried; beyond it, about `STRIDED` more, evenly spaced, and the last.
EVERY_K = 8
STRIDED = 4


@attrs.frozen
class Setup:
    """One way of running the lifecycle: where, which backend, and whether the test
    replaces weights' data between ``wrap_modules`` and ``post_init``."""

    platform: str
    backend: str
    edited: bool

    @property
    def name(self) -> str:
        return f"{self.platform}-{self.backend}-{'edited' if self.edited else 'plain'}"


@attrs.frozen
class Case:
    """One fault: the setup, the phase it is armed for, and the k-th call of `method`
    raising an error of `kind`; `then` is what follows a failed post_init (retry or restore)."""

    setup: Setup
    phase: str
    method: str
    k: int
    kind: str
    then: str = ""

    @property
    def id(self) -> str:
        tail = f"-then-{self.then}" if self.then else ""
        return f"{self.setup.name}-{self.phase}-{self.method}-k{self.k}-{self.kind}{tail}"


# ---- the model, its plans, its edits ---------------------------------------------------------


def build_model() -> nn.Sequential:
    """Tied blocks and transformer blocks: prefetch offloads layers 1 (transformer) and 3
    (tied), uva and on_demand layers 0 (tied) and 1 (transformer); the rest is resident."""
    torch.manual_seed(0)
    return nn.Sequential(TiedBlock(), TransformerBlock(), TransformerBlock(), TiedBlock())


def plan_for(setup: Setup, model: nn.Module) -> OffloadPlan:
    """The plan the setup's platform makes for `model` where its parameters are now."""
    if setup.platform == "cpu":
        return cpu_plan_for(model, setup.backend)
    return gpu_plan(model, setup.backend, pin=True)


def runtime_for(setup: Setup) -> FaultyRuntime:
    """A fresh faulty runtime over the fake of the setup's platform."""
    return FaultyRuntime(FakeRuntime(device="cpu" if setup.platform == "cpu" else "cuda:0"))


def edit(model: nn.Module) -> None:
    """Replace data as a loader's post-processing does (``param.data = new tensor``, the
    same Parameter object): ``mlp.up.weight`` of every transformer block and the tied
    ``a.weight`` (also ``b.weight``) of every tied block, offloaded and resident ones."""
    for layer in layer_list(model):
        if isinstance(layer, TransformerBlock):
            weight = layer.mlp.up.weight
        else:
            assert isinstance(layer, TiedBlock)
            weight = layer.a.weight
        weight.data = torch.round(weight.data * 8) / 8


def activations() -> Iterator[torch.Tensor]:
    """Reproducible activations of different shapes."""
    generator = torch.Generator().manual_seed(5)
    for batch, tokens in ((2, 5), (1, 3)):
        yield torch.randn(batch, tokens, HIDDEN, generator=generator)


# ---- counting calls ---------------------------------------------------------------------------


def dry_counts(setup: Setup) -> dict[str, dict[str, int]]:
    """Calls per phase and method in a run of the lifecycle without faults (at collection
    time, outside the autouse ``no_grad`` fixture: hence its own)."""
    with torch.no_grad():
        return _dry_counts(setup)


def _dry_counts(setup: Setup) -> dict[str, dict[str, int]]:
    model = build_model()
    runtime = runtime_for(setup)
    off = create_offloader(plan_for(setup, model), runtime)
    x = next(activations())
    counts: dict[str, dict[str, int]] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("wrap", lambda: off.wrap_modules(layer_list(model))),
        ("post_init", off.post_init),
        ("forward", lambda: model(x)),
        ("restore", off.restore),
    ]
    for phase, step in steps:
        if phase == "post_init" and setup.edited:
            edit(model)
        runtime.reset_counts()
        step()
        counts[phase] = dict(runtime.counts)
    return counts


def fault_points(count: int) -> list[int]:
    """Which k to fail for a method called `count` times in a phase: every k below
    `EVERY_K`, then about `STRIDED` evenly spaced, and the last."""
    points = set(range(min(count, EVERY_K)))
    if count > EVERY_K:
        stride = max(1, (count - EVERY_K) // STRIDED)
        points.update(range(EVERY_K, count, stride))
        points.add(count - 1)
    return sorted(points)


def setups() -> list[Setup]:
    return [Setup(platform=platform, backend=backend, edited=edited)
            for platform, backends in BACKENDS.items() for backend in backends for edited in (False, True)]


def cases() -> tuple[list[Case], dict[str, dict[str, dict[str, int]]]]:
    """Every case, and the dry-run counts they come from (by setup name)."""
    found: list[Case] = []
    all_counts: dict[str, dict[str, dict[str, int]]] = {}
    for setup in setups():
        counts = dry_counts(setup)
        all_counts[setup.name] = counts
        for phase in PHASES:
            if phase in ("wrap", "forward") and setup.edited:
                # The edit comes after wrap_modules; and a forward runs the same calls on
                # other values: both as the plain case.
                continue
            for method in FAULTABLE:
                for k in fault_points(counts[phase][method]):
                    for kind in KINDS_OF_ERROR:
                        for then in (("retry", "restore") if phase == "post_init" else ("",)):
                            found.append(Case(setup=setup, phase=phase, method=method, k=k, kind=kind, then=then))
    return found, all_counts


CASES, COUNTS = cases()


# ---- checks ----------------------------------------------------------------------------------


def attempt(step: Callable[[], object]) -> BaseException | None:
    """Run `step`; the exception it raised (KeyboardInterrupt included), or None."""
    try:
        step()
    except BaseException as exc:  # a KeyboardInterrupt must not end the test session
        return exc
    return None


def succeeds(step: Callable[[], object], what: str) -> None:
    """`step` must succeed now that the fault is gone (reported as one line if it does not)."""
    error = attempt(step)
    assert error is None, f"{what} failed after the fault: {type(error).__name__}: {error}"


def check_error(error: BaseException | None, runtime: FaultyRuntime, kind: str) -> None:
    """The armed fault fired, and what came out is an `OffloadError` whose cause is the
    injected foreign error, or the injected `KeyboardInterrupt` itself."""
    injected = runtime.fired
    assert injected is not None, "the fault never fired (the dry run's count is off)"
    assert error is not None, f"the injected {injected!r} was swallowed: the call succeeded"
    if kind == "interrupt":
        assert error is injected, f"a KeyboardInterrupt came out as {type(error).__name__}: {error}"
        return
    assert isinstance(error, OffloadError), f"a raw {type(error).__name__} came out: {error}"
    if kind != "execution":
        assert error.__cause__ is injected, (
            f"the {type(error).__name__} ({error}) does not have the injected {injected!r} as its cause "
            f"(cause: {error.__cause__!r})")


def storage_groups(model: nn.Module) -> set[frozenset[str]]:
    """Parameter names grouped by the storage they share (every name, singletons too)."""
    by_storage: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(p.untyped_storage().data_ptr(), set()).add(name)
    return {frozenset(names) for names in by_storage.values()}


def assert_given_back(model: nn.Module, before: dict[str, ParamState], groups: set[frozenset[str]],
                      expected: dict[str, torch.Tensor]) -> None:
    """Every name holds the Parameter object it held before wrapping, with the dtype,
    shape, strides and device it had, the `expected` bits (the resident reference's,
    edited as the model was), and the storage sharing it had."""
    now = dict(model.named_parameters(remove_duplicate=False))
    assert sorted(now) == sorted(before)
    for name, was in before.items():
        p = now[name]
        assert p is was.param, f"{name}: another Parameter object"
        assert (p.dtype, tuple(p.shape), tuple(p.stride()), p.device) == (was.dtype, was.shape, was.stride,
                                                                         was.device), name
        assert torch.equal(bits(p), expected[name]), f"{name}: other bits"
    assert storage_groups(model) == groups


def assert_clean(model: nn.Module) -> None:
    """No instance ``forward``, forward or state_dict hook, or offload mark on any module."""
    for name, module in model.named_modules():
        assert "forward" not in module.__dict__, f"{name or 'model'}: instance forward left"
        assert "_offload_mark" not in module.__dict__, f"{name or 'model'}: offload mark left"
        assert not module._state_dict_hooks, f"{name or 'model'}: state_dict hook left"
        assert not module._forward_hooks and not module._forward_pre_hooks, f"{name or 'model'}: forward hook left"


def assert_host_released(runtime: FaultyRuntime) -> None:
    """Every page-locked host copy the runtime made was given back (`release_host`),
    but for those whose release the test itself failed."""
    fake = runtime.inner
    pinned = sum(1 for e in fake.log if isinstance(e, (HostCopy, HostEmpty)) and e.pin is not PinMethod.NONE)
    pinned -= fake.pin_fallbacks
    released = sum(1 for e in fake.entries(Release) if e.pinned)
    assert pinned == released + len(runtime.unreleased), (
        f"{pinned - released - len(runtime.unreleased)} page-locked host copies never released")


def assert_device_released(runtime: FaultyRuntime, *errors: BaseException | None) -> None:
    """No device memory the runtime handed out is still alive (after letting go of the
    frames `errors` hold, which may reference device tensors)."""
    for error in (*errors, runtime.fired):
        while error is not None:
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
    runtime.fired = None
    assert runtime.inner.device_live_bytes == 0, f"{runtime.inner.device_live_bytes} device bytes still alive"


# ---- the matrix ------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Expected:
    """What the resident model (never wrapped, edited as the case's model is) holds and
    computes: each name's bits, and its output for each of `activations`."""

    bits: dict[str, torch.Tensor]
    outputs: list[torch.Tensor]


@functools.cache
def expected(edited: bool) -> Expected:
    """The resident reference, computed once per edit (the model is deterministic)."""
    with torch.no_grad():
        reference = build_model()
        if edited:
            edit(reference)
        return Expected(bits={name: bits(p).clone() for name, p in reference.named_parameters(remove_duplicate=False)},
                        outputs=[reference(x) for x in activations()])


@functools.cache
def cached_plan(setup: Setup) -> OffloadPlan:
    """The setup's plan (a pure value: the same for every fresh model)."""
    return plan_for(setup, build_model())


@attrs.define
class Run:
    """A fresh model, what it was before wrapping, and an offloader on a faulty runtime."""

    setup: Setup
    model: nn.Sequential
    before: dict[str, ParamState]
    groups: set[frozenset[str]]
    runtime: FaultyRuntime
    off: Offloader

    @classmethod
    def start(cls, setup: Setup) -> Run:
        model = build_model()
        runtime = runtime_for(setup)
        return cls(setup=setup, model=model, before=snapshot(model), groups=storage_groups(model), runtime=runtime,
                   off=create_offloader(cached_plan(setup), runtime))

    def wrap(self) -> None:
        self.off.wrap_modules(layer_list(self.model))

    def edit(self) -> None:
        if self.setup.edited:
            edit(self.model)

    def forward(self) -> Any:
        return self.model(next(activations()))

    def assert_runs_resident(self) -> None:
        """The model computes what the resident reference does, bit for bit."""
        for x, want in zip(activations(), expected(self.setup.edited).outputs, strict=True):
            out = self.model(x)
            assert out.dtype == want.dtype and torch.equal(bits(out), bits(want)), \
                f"output differs for {tuple(x.shape)}"

    def assert_runs_resident_or_says_restore_is_unfinished(self) -> None:
        """After a failed restore: the model computes what the resident reference does, bit
        for bit, or every forward raises an `ExecutionError` saying the restore did not
        finish (never another error, never other values)."""
        try:
            self.assert_runs_resident()
        except ExecutionError as exc:
            assert "restore() stopped part way and did not finish" in str(exc), str(exc)
            assert exc.name == "state"

    def faulted(self, case: Case, step: Callable[[], object]) -> BaseException | None:
        """Run `step` with the case's fault armed (counting from its start), then disarm."""
        self.runtime.reset_counts()
        self.runtime.arm(case.method, case.k, lambda: make_error(case.kind, case.method, case.k))
        try:
            return attempt(step)
        finally:
            self.runtime.disarm()

    def finish(self, *errors: BaseException | None) -> None:
        """Restore succeeded: weights given back, nothing left behind."""
        assert_given_back(self.model, self.before, self.groups, expected(self.setup.edited).bits)
        assert_clean(self.model)
        assert_host_released(self.runtime)
        assert_device_released(self.runtime, *errors)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case) -> None:
    run = Run.start(case.setup)
    if case.phase == "wrap":
        error = run.faulted(case, run.wrap)
        check_error(error, run.runtime, case.kind)
        run.finish(error)
        return
    run.wrap()
    run.edit()
    if case.phase == "post_init":
        error = run.faulted(case, run.off.post_init)
        check_error(error, run.runtime, case.kind)
        # The documented intermediate state: still wrapped, no static buffers held.
        assert run.off.stats().device_buffer_bytes == 0
        if case.then == "retry":
            succeeds(run.off.post_init, "post_init() again")
            run.assert_runs_resident()
        succeeds(run.off.restore, "restore()")
        run.finish(error)
        return
    run.off.post_init()
    if case.phase == "forward":
        error = run.faulted(case, run.forward)
        check_error(error, run.runtime, case.kind)
        run.assert_runs_resident()
        succeeds(run.off.restore, "restore()")
        run.finish(error)
        return
    assert case.phase == "restore"
    run.assert_runs_resident()
    error = run.faulted(case, run.off.restore)
    check_error(error, run.runtime, case.kind)
    if isinstance(error, OffloadError) and "stopped after giving back" not in str(error):
        # Failures inside the restorer say how far it got, whatever the runtime raised
        # (an ExecutionError of the runtime's too); the others say nothing was restored
        # or that only the last wait failed.
        assert "nothing restored" in str(error) or "waiting for the device failed" in str(error) \
            or "could not wait" in str(error) or "replaced by a meta tensor" in str(error), str(error)
    run.assert_runs_resident_or_says_restore_is_unfinished()
    succeeds(run.off.restore, "restore() again")
    run.finish(error)


def test_the_matrix_covers_every_phase_and_backend() -> None:
    """The dry runs found calls to fail in every phase of every offloading backend (a
    miscount would silently shrink the matrix), and every kind of error is tried."""
    # Phases that make no runtime call: on this machine nothing of a none plan, and no
    # wrap (pageable host weights are adopted in place); zero-copy views need none in a forward.
    idle = {("cpu", "none", phase) for phase in PHASES} | {("cpu", backend, "wrap") for backend in BACKENDS["cpu"]}
    idle |= {("cuda-pin", "none", "post_init"), ("cuda-pin", "none", "forward"), ("cuda-pin", "uva", "forward")}
    for setup in setups():
        for phase in PHASES:
            calls = sum(COUNTS[setup.name][phase].values())
            if (setup.platform, setup.backend, phase) in idle:
                assert calls == 0, (setup.name, phase)
            else:
                assert calls > 0, (setup.name, phase)
    assert {c.kind for c in CASES} == set(KINDS_OF_ERROR)
    assert {c.phase for c in CASES} == set(PHASES)
