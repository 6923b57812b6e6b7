"""Followers ask the device whether it takes read-only registrations
(cudaDevAttrHostRegisterReadOnlySupported, attribute 113) before registering their
read-only mapping; where it says 0 nothing is attempted, the copy stays pageable, logged
once and counted as a pin fallback. The answer is played by fake CUDA calls."""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterator

import attrs
import pytest
import torch

from offload import EnvSnapshot, OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.pure.decide.pinning import PinMethod
from offload.pure.sharing.plan import SegmentLayout, lay_out
from offload.sharing import ShareWith, share_offloader
from offload.sharing.coordinate import Membership
from offload.sharing.pinning import (
    ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED,
    HOST_REGISTER_DEFAULT,
    HOST_REGISTER_FOLLOWER,
    PinCalls,
)
from offload.sharing.segment import SegmentMapping
from offload.sharing.source import SharedHostSource
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE
from tests.executors.models import layer_list, transformer_model
from tests.sharing.fakes import FakePins, mapped_twice
from tests.sharing.members import run_members
from tests.sharing.scenarios import CONFIGS, build, inputs_of, shared

CUDA = torch.device("cuda", 0)
UNSUPPORTED = "does not support read-only registration"


@attrs.define
class Answers:
    """Plays cudaDeviceGetAttribute(cudaDevAttrHostRegisterReadOnlySupported): `value`, and
    how often it was asked."""

    value: int | None
    asked: int = 0

    def __call__(self) -> int | None:
        self.asked += 1
        return self.value


def calls_answering(pins: FakePins, answers: Answers) -> PinCalls:
    return attrs.evolve(pins.calls(), read_only_supported=answers)


def plan() -> OffloadPlan:
    model = transformer_model(2, hidden=32)
    return make_plan(describe_layers(layer_list(model)), OffloadConfig(group_size=1, num_in_group=1, prefetch_step=2),
                     EnvSnapshot())


@pytest.fixture
def segment() -> Iterator[tuple[SegmentLayout, SegmentMapping, SegmentMapping]]:
    layout = lay_out(plan(), mmap.PAGESIZE)
    yield layout, *mapped_twice(layout)


def weights() -> dict[tuple[int, str], torch.Tensor]:
    model = transformer_model(2, hidden=32)
    return {(int(n.split(".")[0]), n.split(".", 1)[1]): p.detach() for n, p in model.named_parameters()}


def sources(layout: SegmentLayout, leader: SegmentMapping, follower: SegmentMapping,
            calls: PinCalls) -> tuple[SharedHostSource, SharedHostSource]:
    lead = SharedHostSource(layout, leader=True, rank=0, leader_rank=0, pin=PinMethod.REGISTER, device=CUDA,
                            pin_calls=calls)
    follow = SharedHostSource(layout, leader=False, rank=1, leader_rank=0, pin=PinMethod.REGISTER, device=CUDA,
                              pin_calls=calls)
    lead.attach(leader)
    follow.attach(follower)
    return lead, follow


def fill(layout: SegmentLayout, lead: SharedHostSource, follow: SharedHostSource) -> None:
    """The leader writes every slot; the follower takes every one."""
    w = weights()
    refs = [s.ref for s in layout.slots]
    for ref in refs:
        lead.copy(ref, w[ref])
    follow.allow(refs)
    for ref in refs:
        assert follow.copy(ref, w[ref]) is not None  # given, registered or not


def test_the_attribute_is_cudas_number_for_read_only_registration() -> None:
    # cudaDevAttrHostRegisterReadOnlySupported = 113 in driver_types.h (CUDA 11.1 and later).
    assert ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED == 113


def test_a_device_without_read_only_registration_leaves_the_followers_copy_pageable_without_trying(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping], caplog: pytest.LogCaptureFixture) -> None:
    layout, leader, follower = segment
    pins, answers = FakePins(), Answers(0)
    lead, follow = sources(layout, leader, follower, calls_answering(pins, answers))
    with caplog.at_level(logging.WARNING):
        fill(layout, lead, follow)
    slots = len(layout.slots)
    assert [flags for _, _, flags in pins.registered] == [HOST_REGISTER_DEFAULT] * slots  # the leader's only
    assert all(leader.base <= p < leader.base + leader.nbytes for p, _, _ in pins.registered)
    assert follow.fallbacks == slots and lead.fallbacks == 0  # each slot counted
    assert answers.asked == 1  # asked once, by the follower
    warned = [r.getMessage() for r in caplog.records if UNSUPPORTED in r.getMessage()]
    assert len(warned) == 1 and "rank 1" in warned[0] and "cudaDevAttrHostRegisterReadOnlySupported is 0" in warned[0]
    follow.close()
    lead.close()
    assert sorted(pins.unregistered) == sorted(p for p, _, _ in pins.registered)  # nothing more to undo


@pytest.mark.parametrize("answer", [1, None])
def test_a_device_that_takes_them_or_cannot_say_gets_the_read_only_registration(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping], answer: int | None,
        caplog: pytest.LogCaptureFixture) -> None:
    layout, leader, follower = segment
    pins, answers = FakePins(), Answers(answer)
    lead, follow = sources(layout, leader, follower, calls_answering(pins, answers))
    with caplog.at_level(logging.WARNING):
        fill(layout, lead, follow)
    slots = len(layout.slots)
    assert [flags for _, _, flags in pins.registered] == [HOST_REGISTER_DEFAULT] * slots + [HOST_REGISTER_FOLLOWER] * slots
    assert follow.fallbacks == 0 and answers.asked == 1
    assert not [r for r in caplog.records if UNSUPPORTED in r.getMessage()]
    follow.close()
    lead.close()


def test_a_refused_registration_after_a_yes_is_still_a_fallback(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    slots = len(layout.slots)
    pins, answers = FakePins(fail={slots}), Answers(1)  # the follower's first registration fails
    lead, follow = sources(layout, leader, follower, calls_answering(pins, answers))
    fill(layout, lead, follow)
    assert follow.fallbacks == 1 and len(pins.registered) == 2 * slots
    follow.close()
    lead.close()


def test_a_follower_on_such_a_device_runs_from_the_shared_copy_without_registering() -> None:
    platform = attrs.evolve(CUDA_LIKE, host_pointer_for_registered_memory=True)
    pins = FakePins()
    answers = [Answers(0), Answers(0)]
    lock = threading.Lock()

    def member(rank: int, m: Membership) -> tuple[bool, str, int, int, int]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        the_plan = make_plan(describe_layers(layer_list(model)), CONFIGS["prefetch"], EnvSnapshot(platform=platform))
        assert the_plan.pin.method is PinMethod.REGISTER
        with lock:
            calls = calls_answering(pins, answers[rank])
        off = shared(share_offloader(the_plan, FakeRuntime(device="cuda:0"), ShareWith(timeout_s=10.0),
                                     membership=m, pin_calls=calls))
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs_of(4, 32))
        equal = bool(torch.equal(model(x), resident(x)))
        segment = off.segment
        assert segment is not None
        base, end = segment.base, segment.base + segment.nbytes
        inside = sum(1 for p, _, _ in pins.registered if base <= p < end)
        off.restore()
        return equal, off.sharing.role, inside, len(off.layout.slots), answers[rank].asked

    (lead_ok, lead_role, lead_inside, slots, lead_asked), (ok, role, inside, _, asked) = (
        o.get() for o in run_members(2, member))
    assert (lead_role, role) == ("leader", "follower") and lead_ok and ok
    assert lead_inside == slots and lead_asked == 0  # the leader registers as before, without asking
    assert inside == 0 and asked == 1  # the follower asked once and registered nothing
