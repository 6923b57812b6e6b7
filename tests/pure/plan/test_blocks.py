"""offload.pure.plan.blocks: which host copies share a block, which buffers an arena, and
which copies merge."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload import EnvSnapshot, LayerSpec, ModelSpec, OffloadConfig, OffloadPlan, ParamSpec, Platform, make_plan
from offload.errors import ConfigError
from offload.pure import contiguous_stride
from offload.pure.decide.moves import Move
from offload.pure.plan.blocks import (
    ALIGN,
    Span,
    aligned,
    copies_per_step,
    host_blocks,
    layer_copies,
    merge_spans,
    slot_arenas,
)

GPU = EnvSnapshot(platform=Platform(has_cuda=True, device_total_bytes=1 << 40, can_map_host_memory=True))


def p(name: str, *shape: int, stride: tuple[int, ...] | None = None, key: str | None = None) -> ParamSpec:
    return ParamSpec(name=name, shape=shape, stride=contiguous_stride(shape) if stride is None else stride,
                     dtype="float32", itemsize=4, storage_key=key, device="cuda:0")


def layer_params(i: int) -> tuple[ParamSpec, ...]:
    # w and up: 64 x 4 floats = 1 KiB, aligned; b: 8 floats, not; norm: 64 floats = 256 B, aligned.
    return (p("w", 64, 4), p("b", 8), p("up", 64, 4), p("norm", 64))


def spec(layers: int, params: object = layer_params) -> ModelSpec:
    assert callable(params)
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"l{i}", params=params(i)) for i in range(layers)))


def plan_for(model: ModelSpec, blocks: str = "auto", **config: int) -> OffloadPlan:
    options = {"group_size": 1, "prefetch_step": 2, **config}
    return make_plan(model, OffloadConfig(layer_blocks=blocks, **options), GPU)  # type: ignore[arg-type]


def moves(plan: OffloadPlan, move: Move) -> dict[tuple[int, str], Move]:
    return {(q.layer, q.name): move for q in plan.offloaded_params}


# ---- aligned ----------------------------------------------------------------------------


def test_aligned_needs_a_dense_non_empty_multiple_of_256_bytes() -> None:
    assert ALIGN == 256
    assert aligned(p("w", 64))  # 256 bytes
    assert aligned(p("w", 16, 16))  # 1 KiB
    assert aligned(p("t", 16, 32, stride=(1, 16)))  # a transpose is dense
    assert not aligned(p("w", 63))  # 252 bytes
    assert not aligned(p("w", 0))  # empty
    assert not aligned(p("s", 64, stride=(2,)))  # every other element: not dense (its span is 508 bytes)


def test_config_refuses_an_unknown_layer_blocks_value_by_name() -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(layer_blocks="sometimes")  # type: ignore[arg-type]
    assert info.value.name == "layer_blocks"


# ---- host_blocks ------------------------------------------------------------------------


def test_each_layer_gets_one_block_of_its_aligned_copies_back_to_back() -> None:
    plan = plan_for(spec(4))
    blocks = host_blocks(plan, moves(plan, Move.TO_HOST))
    assert [b.layer for b in blocks] == list(plan.offloaded_layers)
    for b in blocks:
        assert b.names == ("w", "up", "norm")  # b (32 bytes) keeps its own copy
        assert b.offsets == (0, 1024, 2048)
        assert b.nbytes == 1024 + 1024 + 256


@pytest.mark.parametrize("move", [Move.TO_HOST, Move.HOST_TO_PINNED, Move.NEW_ON_HOST])
def test_auto_makes_blocks_where_a_copy_is_made_anyway(move: Move) -> None:
    plan = plan_for(spec(2))
    assert len(host_blocks(plan, moves(plan, move))) == 2


def test_adopted_tensors_join_blocks_only_with_always() -> None:
    auto = plan_for(spec(2))
    assert host_blocks(auto, moves(auto, Move.ADOPT)) == ()
    always = plan_for(spec(2), "always")
    assert len(host_blocks(always, moves(always, Move.ADOPT))) == 2


def test_never_makes_no_block() -> None:
    plan = plan_for(spec(2), "never")
    assert host_blocks(plan, moves(plan, Move.TO_HOST)) == ()


def test_a_layer_with_one_aligned_copy_gets_no_block() -> None:
    plan = plan_for(spec(3, lambda i: (p("w", 64, 4), p("b", 8))))
    assert host_blocks(plan, moves(plan, Move.TO_HOST)) == ()


def test_ties_and_resident_layers_stay_out() -> None:
    # Layer i's "tied" is the same storage as its "w": only the first name owns a copy.
    def params(i: int) -> tuple[ParamSpec, ...]:
        return (p("w", 64, 4, key=f"k{i}"), p("tied", 64, 4, key=f"k{i}"), p("up", 64, 4))

    plan = plan_for(spec(4, params), group_size=2)  # every 2nd layer offloaded
    blocks = host_blocks(plan, moves(plan, Move.TO_HOST))
    assert [b.layer for b in blocks] == list(plan.offloaded_layers) == [1, 3]
    assert all(b.names == ("w", "up") for b in blocks)


def test_a_weight_whose_move_is_unknown_stays_out() -> None:
    plan = plan_for(spec(1))
    partial = {(0, "w"): Move.TO_HOST, (0, "up"): Move.TO_HOST}  # norm not found
    (block,) = host_blocks(plan, partial)
    assert block.names == ("w", "up")


# ---- slot_arenas ------------------------------------------------------------------------


def test_each_slot_gets_an_arena_of_the_aligned_buffers_in_buffer_order() -> None:
    plan = plan_for(spec(4), prefetch_step=2)
    arenas = slot_arenas(plan.buffers)
    slots = sorted({s for b in plan.buffers for s in b.slots})
    assert [a.slot for a in arenas] == slots
    aligned_keys = [(b.name, b.shape, b.stride, b.dtype) for b in plan.buffers if b.slot_bytes % ALIGN == 0]
    for a in arenas:
        assert list(a.keys) == aligned_keys
        assert a.offsets == (0, 1024, 2048)
        assert a.nbytes == 1024 + 1024 + 256
    # Arenas hold exactly the bytes of their buffers: nothing is padded.
    arena_bytes = sum(a.nbytes for a in arenas)
    assert arena_bytes == sum(b.slot_bytes * len(b.slots) for b in plan.buffers if b.slot_bytes % ALIGN == 0)


def test_a_slot_with_one_aligned_buffer_gets_no_arena() -> None:
    plan = plan_for(spec(2, lambda i: (p("w", 64, 4), p("b", 8))))
    assert slot_arenas(plan.buffers) == ()


# ---- merge_spans ------------------------------------------------------------------------

A, B, H, G = object(), object(), object(), object()


def test_adjacent_spans_merge_in_address_order_and_others_stay_alone() -> None:
    spans = [
        Span(dst=A, dst_offset=1024, src=H, src_offset=1024, nbytes=256),
        Span(dst=None, dst_offset=0, src=None, src_offset=0, nbytes=32),
        Span(dst=A, dst_offset=0, src=H, src_offset=0, nbytes=1024),
        Span(dst=A, dst_offset=2048, src=H, src_offset=1280, nbytes=64),  # a gap in the destination
    ]
    assert merge_spans(spans) == [[2, 0], [1], [3]]


def test_spans_in_different_allocations_do_not_merge() -> None:
    spans = [Span(dst=A, dst_offset=0, src=H, src_offset=0, nbytes=8),
             Span(dst=B, dst_offset=8, src=H, src_offset=8, nbytes=8),
             Span(dst=A, dst_offset=8, src=G, src_offset=8, nbytes=8)]
    assert merge_spans(spans) == [[0], [1], [2]]


def test_a_source_gap_stops_a_merge() -> None:
    spans = [Span(dst=A, dst_offset=0, src=H, src_offset=0, nbytes=8),
             Span(dst=A, dst_offset=8, src=H, src_offset=16, nbytes=8)]
    assert merge_spans(spans) == [[0], [1]]


@st.composite
def span_lists(draw: st.DrawFn) -> list[Span]:
    """Spans cut from a few allocations: runs of adjacent pieces, shuffled, some alone."""
    dsts, srcs = [object(), object()], [object(), object()]
    spans: list[Span] = []
    runs = draw(st.integers(0, 4))
    for run, src_run in enumerate(draw(st.permutations(range(runs)))):
        # Runs never overlap nor touch: each starts 10,000 bytes from the next (it spans at most 1,520).
        dst, src = draw(st.sampled_from(dsts)), draw(st.sampled_from(srcs))
        at_dst, at_src = run * 10_000, src_run * 10_000
        for size in draw(st.lists(st.integers(1, 300), min_size=1, max_size=5)):
            spans.append(Span(dst=dst, dst_offset=at_dst, src=src, src_offset=at_src, nbytes=size))
            at_dst, at_src = at_dst + size, at_src + size + draw(st.sampled_from([0, 0, 0, 4]))
    spans += [Span(dst=None, dst_offset=0, src=None, src_offset=0, nbytes=1)] * draw(st.integers(0, 2))
    return draw(st.permutations(spans))


@given(span_lists())
def test_merged_groups_cover_every_span_once_and_are_contiguous_and_maximal(spans: list[Span]) -> None:
    groups = merge_spans(spans)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(spans)))
    assert [min(g) for g in groups] == sorted(min(g) for g in groups)
    for g in groups:
        for a, b in zip(g, g[1:], strict=False):
            x, y = spans[a], spans[b]
            assert x.dst is y.dst and x.src is y.src
            assert y.dst_offset == x.dst_offset + x.nbytes and y.src_offset == x.src_offset + x.nbytes
        if len(g) > 1:
            assert all(spans[i].dst is not None for i in g)
    # Maximal: no group's last span is followed, in both allocations, by another group's first.
    for g in groups:
        last = spans[g[-1]]
        for h in groups:
            if h is g or last.dst is None:
                continue
            first = spans[h[0]]
            assert not (first.dst is last.dst and first.src is last.src
                        and first.dst_offset == last.dst_offset + last.nbytes
                        and first.src_offset == last.src_offset + last.nbytes)


# ---- layer_copies -----------------------------------------------------------------------


def test_layer_copies_merge_the_aligned_weights_and_leave_the_rest_alone() -> None:
    plan = plan_for(spec(4))
    # w, up and norm lie back to back in the block and the arena: one copy; b alone: one more.
    assert layer_copies(plan) == (2, 2, 2, 2)
    assert layer_copies(plan, moves(plan, Move.ADOPT)) == (4, 4, 4, 4)  # adopted: no block under auto
    never = plan_for(spec(4), "never")
    assert layer_copies(never) == (4, 4, 4, 4)


def test_layer_copies_count_a_layer_tie_once_and_nothing_for_other_backends() -> None:
    def params(i: int) -> tuple[ParamSpec, ...]:
        return (p("w", 64, 4, key=f"k{i}"), p("tied", 64, 4, key=f"k{i}"), p("up", 64, 4))

    plan = plan_for(spec(3, params))
    assert layer_copies(plan) == (1, 1, 1)  # w and up; the tie reads w's buffer
    uva = make_plan(spec(2), OffloadConfig(backend="uva", uva_max_bytes=1 << 20), GPU)
    assert layer_copies(uva) == ()


# ---- copies_per_step --------------------------------------------------------------------


def test_copies_per_step_leave_out_the_layers_loaded_once() -> None:
    # 4 offloaded layers at depth 2: slots 0, 1, 0, 1, every slot shared: each layer is
    # copied every step, as many copies as layer_copies says.
    shared = plan_for(spec(4))
    assert copies_per_step(shared) == layer_copies(shared) == (2, 2, 2, 2)
    # 3 layers at depth 2: slot 1 is layer 1's alone; it is copied once, at the start.
    lone = plan_for(spec(3))
    assert layer_copies(lone) == (2, 2, 2)
    assert copies_per_step(lone) == (2, 0, 2)
    assert copies_per_step(lone, moves(lone, Move.ADOPT)) == (4, 0, 4)
    # 2 layers at depth 2: both alone, nothing is copied per step.
    assert copies_per_step(plan_for(spec(2))) == (0, 0)
    assert copies_per_step(plan_for(spec(5), prefetch_step=5)) == (0, 0, 0, 0, 0)
    uva = make_plan(spec(2), OffloadConfig(backend="uva", uva_max_bytes=1 << 20), GPU)
    assert copies_per_step(uva) == ()
