"""`SharedHostSource` and `HostStore` with a source: leader and follower over one segment
in this process, and page-locking as the plan says through fake CUDA calls."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import pytest
import torch

from offload import EnvSnapshot, ExecutionError, OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.executors.hoststore import HostStore
from offload.pure.decide.moves import Move
from offload.pure.decide.pinning import PinMethod
from offload.pure.sharing.plan import CACHE_LINE, SegmentLayout, lay_out
from offload.runtime.cpu import CpuRuntime
from offload.sharing.pinning import HOST_REGISTER_DEFAULT, HOST_REGISTER_FOLLOWER, HOST_REGISTER_READ_ONLY
from offload.sharing.segment import SegmentMapping
from offload.sharing.source import SharedHostSource, same_sample
from tests.executors.models import layer_list, transformer_model
from tests.sharing.fakes import FakePins, mapped_twice

PAGE = 4096
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def plan() -> OffloadPlan:
    model = transformer_model(2, hidden=32)
    return make_plan(describe_layers(layer_list(model)), OffloadConfig(group_size=1, num_in_group=1, prefetch_step=2),
                     EnvSnapshot())


def weights() -> dict[tuple[int, str], torch.Tensor]:
    model = transformer_model(2, hidden=32)
    return {(int(n.split(".")[0]), n.split(".", 1)[1]): p.detach() for n, p in model.named_parameters()}


@pytest.fixture
def segment() -> Iterator[tuple[SegmentLayout, SegmentMapping, SegmentMapping]]:
    layout = lay_out(plan(), PAGE)
    yield layout, *mapped_twice(layout)


def sources(layout: SegmentLayout, leader: SegmentMapping, follower: SegmentMapping, *, pin: PinMethod = PinMethod.NONE,
            device: torch.device = CPU, pins: FakePins | None = None, piece_bytes: int = 1 << 30,
            ) -> tuple[SharedHostSource, SharedHostSource]:
    calls = pins.calls() if pins is not None else None
    lead = SharedHostSource(layout, leader=True, rank=0, leader_rank=0, pin=pin, device=device, pin_calls=calls,
                            piece_bytes=piece_bytes)
    follow = SharedHostSource(layout, leader=False, rank=1, leader_rank=0, pin=pin, device=device, pin_calls=calls,
                              piece_bytes=piece_bytes)
    lead.attach(leader)
    follow.attach(follower)
    return lead, follow


def test_the_leader_writes_and_a_follower_gets_the_same_bits_read_only_once_allowed(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    lead, follow = sources(layout, leader, follower)
    w = weights()
    ref = layout.slots[2].ref
    assert follow.copy(ref, w[ref]) is None  # not written yet
    written = lead.copy(ref, w[ref])
    assert written is not None and leader.contains(written) and torch.equal(written, w[ref])
    assert lead.written() == [ref]
    follow.allow([ref])
    got = follow.copy(ref, w[ref])
    assert got is not None and follower.contains(got) and torch.equal(got, w[ref])
    assert follow.copy(ref, got) is got  # already the slot: given back as is
    assert follow.release(got) and not follow.release(w[ref])  # ours, and not ours
    assert follow.copy((9, "nothing"), w[ref]) is None  # no slot


def test_a_follower_weight_that_differs_is_refused_and_one_that_does_not_fit_goes_private(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    lead, follow = sources(layout, leader, follower)
    w = weights()
    ref = layout.slots[2].ref
    lead.copy(ref, w[ref])
    follow.allow([ref])
    other = w[ref].clone()
    other.view(-1)[-1] += 1  # the last element is sampled
    named = re.escape(f"rank 1's weight layer {ref[0]} parameter {ref[1]!r} differs from the shared host copy rank 0")
    with pytest.raises(ExecutionError, match=named):
        follow.copy(ref, other)
    assert follow.copy(ref, w[ref].double()) is None
    assert lead.copy(ref, w[ref].t()) is None  # another stride: a private copy, on the leader too
    unverified = SharedHostSource(layout, leader=False, rank=1, leader_rank=0, pin=PinMethod.NONE, device=CPU,
                                  verify=False)
    unverified.attach(follower)
    unverified.allow([ref])
    assert unverified.copy(ref, other) is not None  # verify off: the leader's copy is taken as is


def test_the_leader_gives_its_slots_to_a_loader_followers_get_private_memory(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    lead, follow = sources(layout, leader, follower)
    ref = layout.slots[0].ref
    like = torch.empty(layout.slots[0].shape, device="meta")
    slot = lead.empty(ref, like)
    assert slot is not None and leader.contains(slot) and lead.written() == []  # pending until post_init
    lead.loaded()
    assert lead.written() == [ref]
    assert follow.empty(ref, like) is None


def test_a_store_with_a_source_takes_its_copies_there_and_gives_them_back_there(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    lead, _ = sources(layout, leader, follower)
    store = HostStore(CpuRuntime(), pin=PinMethod.NONE, source=lead)
    w = weights()
    refs = [s.ref for s in layout.slots]
    store.place(refs[0], w[refs[0]], Move.ADOPT)  # adopt: the shared copy, not the tensor itself
    store.put(refs[1], w[refs[1]])
    store.place(refs[2], torch.empty(layout.slots[2].shape, device="meta"), Move.NEW_ON_HOST)
    copies = [store.get(r) for r in refs[:3]]
    assert all(c is not None and leader.contains(c) for c in copies)
    private = HostStore(CpuRuntime(), pin=PinMethod.NONE, source=None)
    private.place(refs[0], w[refs[0]], Move.ADOPT)
    assert private.get(refs[0]) is w[refs[0]]  # without a source: adopted as before
    store.put(refs[1], w[refs[1]].double())  # no longer fits: private, and the slot is given back
    held = store.get(refs[1])
    assert held is not None and not leader.contains(held) and refs[1] not in lead.written()
    store.clear()
    assert lead.written() == []


def test_registration_is_per_slot_read_only_on_followers_and_undone_on_close(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    pins = FakePins()
    lead, follow = sources(layout, leader, follower, pin=PinMethod.REGISTER, device=CUDA, pins=pins)
    w = weights()
    refs = [s.ref for s in layout.slots]
    for ref in refs:
        lead.copy(ref, w[ref])
    follow.allow(refs)
    for ref in refs:
        follow.copy(ref, w[ref])
    assert len(pins.registered) == 2 * len(refs)
    leader_calls, follower_calls = pins.registered[:len(refs)], pins.registered[len(refs):]
    assert {flags for _, _, flags in leader_calls} == {HOST_REGISTER_DEFAULT}
    assert {flags for _, _, flags in follower_calls} == {HOST_REGISTER_FOLLOWER}
    assert HOST_REGISTER_FOLLOWER & HOST_REGISTER_READ_ONLY
    for (pointer, nbytes, _), s in zip(follower_calls, layout.slots, strict=True):
        assert pointer == follower.base + s.offset and nbytes == s.nbytes and pointer % PAGE == 0
    lead.copy(refs[0], w[refs[0]])
    assert len(pins.registered) == 2 * len(refs)  # a slot is registered once
    lead.close()
    follow.close()
    assert sorted(pins.unregistered) == sorted(p for p, _, _ in pins.registered)
    assert lead.mapping is None and not lead.owns(w[refs[0]])


def test_large_slots_register_in_pieces_and_a_refusal_leaves_the_slot_pageable(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    pins = FakePins(fail={1})
    lead, _ = sources(layout, leader, follower, pin=PinMethod.REGISTER, device=CUDA, pins=pins, piece_bytes=1024)
    w = weights()
    big = max(layout.slots, key=lambda s: s.nbytes)
    assert big.nbytes > 2048
    host = lead.copy(big.ref, w[big.ref])
    assert host is not None and torch.equal(host, w[big.ref])  # still given, pageable
    assert lead.fallbacks == 1
    assert pins.unregistered == [pins.registered[0][0]]  # the piece before the refusal is undone
    assert [n for _, n, _ in pins.registered] == [1024, 1024]


class Ranges:
    """Plays a runtime's `RegisteredRanges`: what it was told, and what it forgot."""

    def __init__(self) -> None:
        self.noted: list[tuple[tuple[int, int], ...]] = []
        self.forgotten: list[tuple[tuple[int, int], ...]] = []

    def note_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        self.noted.append(tuple(pieces))

    def forget_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        self.forgotten.append(tuple(pieces))


def test_slots_registered_in_pieces_are_told_to_the_runtime_and_forgotten_on_close(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    """#13: the runtime cuts copies at registration pieces it knows of; a slot the source
    registered in several pieces must be among them, or its copies cross a boundary."""
    layout, leader, _ = segment
    pins = FakePins()
    ranges = Ranges()
    lead = SharedHostSource(layout, leader=True, rank=0, leader_rank=0, pin=PinMethod.REGISTER, device=CUDA,
                            pin_calls=pins.calls(), piece_bytes=1024, ranges=ranges)
    lead.attach(leader)
    w = weights()
    for s in layout.slots:
        lead.copy(s.ref, w[s.ref])
    multi = [s for s in layout.slots if s.nbytes > 1024]
    assert multi  # the test needs slots larger than one piece
    expected = [tuple((leader.base + s.offset + i, min(1024, s.nbytes - i)) for i in range(0, s.nbytes, 1024))
                for s in multi]
    assert ranges.noted == expected  # one piece only: nothing to cut, nothing told
    lead.close()
    assert sorted(ranges.forgotten) == sorted(expected)


def test_no_registration_without_pinning_or_on_the_cpu(
        segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    pins = FakePins()
    lead, _ = sources(layout, leader, follower, pin=PinMethod.NONE, device=CUDA, pins=pins)
    on_cpu, _ = sources(layout, leader, follower, pin=PinMethod.REGISTER, device=CPU, pins=pins)
    w = weights()
    ref = layout.slots[0].ref
    lead.copy(ref, w[ref])
    on_cpu.copy(ref, w[ref])
    assert pins.registered == []


def test_page_locked_allocations_cannot_be_shared() -> None:
    with pytest.raises(ExecutionError, match="cannot be shared when the plan pins with cudaHostAlloc") as e:
        SharedHostSource(lay_out(plan(), CACHE_LINE), leader=True, rank=0, leader_rank=0, pin=PinMethod.ALLOC,
                         device=CUDA)
    assert e.value.name == "pin"


def test_a_mapping_of_the_wrong_kind_is_refused(segment: tuple[SegmentLayout, SegmentMapping, SegmentMapping]) -> None:
    layout, leader, follower = segment
    source = SharedHostSource(layout, leader=True, rank=0, leader_rank=0, pin=PinMethod.NONE, device=CPU)
    with pytest.raises(ExecutionError, match="mapped read-only but this member is the leader"):
        source.attach(follower)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 3), (2, 3, 4, 5), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_samples_see_a_change_at_a_sampled_position(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    a = torch.zeros(shape, dtype=torch.float32).to(dtype)
    assert same_sample(a, a.clone())
    if a.numel():
        b = a.clone()
        b.view(-1)[0] = torch.ones((), dtype=torch.float32).to(dtype)
        assert not same_sample(a, b)
