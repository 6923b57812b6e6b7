"""How each weight reaches its place (`offload.pure.decide.moves`), and what a plan says it moves.

Known cases are tables written from the rules in the docstrings of `Move`, `decide_move`,
`where_kind` and `restore_target` (resident weights end on the compute device unless the
config keeps host ones on the host; offloaded ones end in host memory: adopted when they
are pageable and the plan does not pin, copied into page-locked memory when it does,
copied from the device, or allocated new from meta), not from the code's branches.
"""

from __future__ import annotations

import itertools

import pytest

from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamPlan,
    ParamSpec,
    Platform,
    make_plan,
    render_plan,
)
from offload.pure.decide.moves import Move, WhereKind, decide_move, move_text, restore_target, where_kind
from offload.pure.decide.pinning import PinMethod

W = WhereKind
PINS = (PinMethod.REGISTER, PinMethod.ALLOC)

# ============================================================================ where_kind

WHERE: list[tuple[str, str, WhereKind]] = [
    # A plan's compute device "cuda" is any CUDA device (the plan does not know which one).
    ("cuda:0", "cuda", W.COMPUTE),
    ("cuda", "cuda", W.COMPUTE),
    ("cuda:1", "cuda", W.COMPUTE),
    ("cpu", "cuda", W.HOST),
    ("meta", "cuda", W.META),
    ("compute", "cuda", W.COMPUTE),
    # A runtime's compute device names one GPU: another one is not something to place from.
    ("cuda:0", "cuda:0", W.COMPUTE),
    ("cuda:1", "cuda:0", W.OTHER),
    ("cuda:1", "cuda:1", W.COMPUTE),
    ("cuda:0", "cuda:1", W.OTHER),
    ("cuda:10", "cuda:1", W.OTHER),  # a prefix of the index is not the same device
    ("cpu", "cuda:0", W.HOST),
    ("meta", "cuda:0", W.META),
    ("compute", "cuda:0", W.COMPUTE),
    # Without an accelerator the host is the compute device.
    ("cpu", "cpu", W.COMPUTE),
    ("meta", "cpu", W.META),
    ("compute", "cpu", W.COMPUTE),
    ("cuda:0", "cpu", W.OTHER),
    ("cuda", "cpu", W.OTHER),
    ("xpu:0", "cuda", W.OTHER),
]


@pytest.mark.parametrize(("device", "compute", "expected"), WHERE, ids=[f"{d}-on-{c}" for d, c, _ in WHERE])
def test_where_kind(device: str, compute: str, expected: WhereKind) -> None:
    assert where_kind(device, compute) is expected


# ============================================================================ decide_move


def expected_move(where: WhereKind, *, offloaded: bool, pin: PinMethod, keep_host: bool,
                  compute_is_host: bool) -> Move:
    """The rules of the `Move` docstrings, written out case by case."""
    in_host_memory = where is W.HOST or (where is W.COMPUTE and compute_is_host)
    table: dict[tuple[WhereKind, bool], Move] = {
        # resident: end on the compute device
        (W.COMPUTE, False): Move.KEEP,
        (W.HOST, False): Move.KEEP if keep_host else Move.TO_DEVICE,
        (W.META, False): Move.NEW_ON_DEVICE,
        # offloaded: end in host memory, pinned as planned
        (W.META, True): Move.NEW_ON_HOST,
        (W.OTHER, False): Move.KEEP,
        (W.OTHER, True): Move.KEEP,  # the caller reports it
    }
    if offloaded and in_host_memory:
        return Move.ADOPT if pin is PinMethod.NONE else Move.HOST_TO_PINNED
    if offloaded and where is W.COMPUTE:
        return Move.TO_HOST
    return table[(where, offloaded)]


#: Every combination `where_kind` can give: with the host as the compute device a host
#: weight is on the compute device, so (HOST, compute_is_host) never reaches decide_move.
COMBINATIONS = [
    (where, offloaded, pin, keep_host, compute_is_host)
    for where, offloaded, pin, keep_host, compute_is_host in itertools.product(
        WhereKind, (False, True), (PinMethod.NONE, *PINS), (False, True), (False, True))
    if not (where is W.HOST and compute_is_host)
]


@pytest.mark.parametrize(("where", "offloaded", "pin", "keep_host", "compute_is_host"), COMBINATIONS)
def test_decide_move_follows_the_documented_rules(where: WhereKind, offloaded: bool, pin: PinMethod,
                                                  keep_host: bool, compute_is_host: bool) -> None:
    got = decide_move(where, offloaded=offloaded, pin=pin, keep_host=keep_host, compute_is_host=compute_is_host)
    assert got is expected_move(where, offloaded=offloaded, pin=pin, keep_host=keep_host,
                                compute_is_host=compute_is_host)


#: The cases people ask about, spelled out: (device, compute, offloaded, pin, keep_host, move).
KNOWN: list[tuple[str, str, bool, PinMethod, bool, Move]] = [
    ("cpu", "cuda:0", True, PinMethod.NONE, False, Move.ADOPT),
    ("cpu", "cuda:0", True, PinMethod.ALLOC, False, Move.HOST_TO_PINNED),
    ("cpu", "cuda:0", True, PinMethod.REGISTER, True, Move.HOST_TO_PINNED),  # keep_host is for resident ones
    ("cuda:0", "cuda:0", True, PinMethod.ALLOC, False, Move.TO_HOST),
    ("cuda:0", "cuda:0", True, PinMethod.NONE, False, Move.TO_HOST),
    ("meta", "cuda:0", True, PinMethod.ALLOC, False, Move.NEW_ON_HOST),
    ("meta", "cpu", True, PinMethod.NONE, False, Move.NEW_ON_HOST),
    ("cpu", "cpu", True, PinMethod.NONE, False, Move.ADOPT),  # a CPU plan never copies
    ("cpu", "cpu", False, PinMethod.NONE, False, Move.KEEP),
    ("cpu", "cuda:0", False, PinMethod.ALLOC, False, Move.TO_DEVICE),
    ("cpu", "cuda:0", False, PinMethod.NONE, True, Move.KEEP),
    ("cuda:0", "cuda:0", False, PinMethod.ALLOC, False, Move.KEEP),
    ("meta", "cuda:0", False, PinMethod.NONE, True, Move.NEW_ON_DEVICE),
    ("meta", "cpu", False, PinMethod.NONE, False, Move.NEW_ON_DEVICE),
    ("cuda:1", "cuda:0", True, PinMethod.ALLOC, False, Move.KEEP),
]


@pytest.mark.parametrize(("device", "compute", "offloaded", "pin", "keep_host", "expected"), KNOWN)
def test_known_moves_from_device_names(device: str, compute: str, offloaded: bool, pin: PinMethod,
                                       keep_host: bool, expected: Move) -> None:
    where = where_kind(device, compute)
    got = decide_move(where, offloaded=offloaded, pin=pin, keep_host=keep_host, compute_is_host=compute == "cpu")
    assert got is expected


# ============================================================================ restore_target

RESTORE = [
    (Move.TO_DEVICE, W.HOST),  # came from the host: goes back there
    (Move.ADOPT, W.HOST),
    (Move.HOST_TO_PINNED, W.HOST),
    (Move.TO_HOST, W.COMPUTE),  # came from the device: goes back there
    (Move.NEW_ON_DEVICE, W.COMPUTE),  # was meta, resident: keeps its place on the device
    (Move.NEW_ON_HOST, W.HOST),  # was meta, offloaded: comes back in host memory
]


@pytest.mark.parametrize(("move", "expected"), RESTORE, ids=[m.value for m, _ in RESTORE])
def test_restore_target(move: Move, expected: WhereKind) -> None:
    assert restore_target(move) is expected


def test_restore_never_puts_a_weight_on_meta_or_another_device() -> None:
    assert {restore_target(m) for m in Move} <= {W.HOST, W.COMPUTE}


def test_every_move_has_words_for_people() -> None:
    texts = [move_text(m) for m in Move]
    assert all(texts) and len(set(texts)) == len(texts)


# ============================================================================ planned_moves

GPU = Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=10**6, can_map_host_memory=True)


def param(name: str, elements: int, device: str, key: str | None = None) -> ParamSpec:
    """A 1-D float16 parameter: ``2 * elements`` bytes."""
    return ParamSpec(name=name, shape=(elements,), stride=(1,), dtype="float16", itemsize=2, device=device,
                     storage_key=key)


def layer_params(index: int) -> tuple[ParamSpec, ...]:
    """One parameter on each kind of device, and a tied pair (one storage) on the host."""
    return (
        param("h", 50, "cpu"),  # 100 B
        param("g", 100, "cuda:0"),  # 200 B
        param("m", 150, "meta"),  # 300 B
        param("c", 200, "compute"),  # 400 B
        param("t1", 25, "cpu", key=f"tie{index}"),  # 50 B, one storage under two names
        param("t2", 25, "cpu", key=f"tie{index}"),
    )


SPEC = ModelSpec(layers=tuple(LayerSpec(index=i, name=f"model.layers.{i}", params=layer_params(i)) for i in range(2)))
#: Prefetch, groups of two layers, the last one offloaded: layer 0 resident, layer 1 offloaded.
PREFETCH_LAYER_1 = OffloadConfig(group_size=2, num_in_group=1)


def moves_of(plan: OffloadPlan) -> dict[Move, tuple[int, int]]:
    return {m: (n, b) for m, n, b in plan.planned_moves()}


def find(plan: OffloadPlan, layer: int, name: str) -> ParamPlan:
    (found,) = [p for p in plan.params if (p.layer, p.name) == (layer, name)]
    return found


def test_planned_moves_with_pinning() -> None:
    plan = make_plan(SPEC, PREFETCH_LAYER_1, EnvSnapshot(platform=GPU))
    assert plan.pin.pin
    assert plan.offloaded_layers == (1,)
    assert moves_of(plan) == {
        Move.KEEP: (2, 200 + 400),  # layer 0: g on the device, c loaded onto it
        Move.TO_DEVICE: (3, 100 + 50),  # layer 0: h, and the tie t1/t2 once
        Move.NEW_ON_DEVICE: (1, 300),  # layer 0: m
        Move.TO_HOST: (2, 200 + 400),  # layer 1: g, c
        Move.HOST_TO_PINNED: (3, 100 + 50),  # layer 1: h, t1/t2 once
        Move.NEW_ON_HOST: (1, 300),  # layer 1: m
    }
    assert [m for m, _, _ in plan.planned_moves()] == sorted(moves_of(plan), key=list(Move).index)


def test_planned_moves_without_pinning_adopt_host_weights() -> None:
    plan = make_plan(SPEC, PREFETCH_LAYER_1, EnvSnapshot(platform=GPU, flags=EnvFlags(disable_pin_memory=True)))
    moves = moves_of(plan)
    assert moves[Move.ADOPT] == (3, 100 + 50)
    assert Move.HOST_TO_PINNED not in moves
    assert moves[Move.TO_HOST] == (2, 600)
    assert moves[Move.TO_DEVICE] == (3, 150)


def test_planned_moves_keep_host_parameters_with_keep_host_params() -> None:
    config = OffloadConfig(group_size=2, num_in_group=1, keep_host_params=True)
    plan = make_plan(SPEC, config, EnvSnapshot(platform=GPU))
    moves = moves_of(plan)
    # h and the tie stay on the host in both layers: nothing is copied to or from the host.
    assert moves[Move.KEEP] == (2 + 3 + 3, 600 + 150 + 150)
    assert Move.TO_DEVICE not in moves
    assert Move.HOST_TO_PINNED not in moves
    assert moves[Move.TO_HOST] == (2, 600)
    assert plan.move_of(find(plan, 1, "h")) is Move.KEEP


def test_planned_moves_on_a_cpu_plan_copy_nothing() -> None:
    plan = make_plan(SPEC, PREFETCH_LAYER_1, EnvSnapshot(platform=Platform()))
    assert not plan.pin.pin
    moves = moves_of(plan)
    # The host is the compute device: host and "compute" weights are adopted in place, a
    # weight on a GPU is not this plan's to place (it stays), meta ones get new memory.
    assert moves == {
        Move.KEEP: (2 + 3 + 1, 100 + 200 + 400 + 50 + 200),
        Move.NEW_ON_DEVICE: (1, 300),
        Move.ADOPT: (4, 100 + 400 + 50),
        Move.NEW_ON_HOST: (1, 300),
    }


def test_move_of_uses_the_live_device_and_compute_device_given() -> None:
    plan = make_plan(SPEC, PREFETCH_LAYER_1, EnvSnapshot(platform=GPU))
    g = find(plan, 1, "g")  # planned on cuda:0, offloaded
    assert plan.move_of(g) is Move.TO_HOST
    assert plan.move_of(g, "cpu", "cuda:0") is Move.HOST_TO_PINNED  # loaded on the host meanwhile
    assert plan.move_of(g, "meta", "cuda:0") is Move.NEW_ON_HOST
    assert plan.move_of(g, "cpu", "cpu") is Move.HOST_TO_PINNED  # run on a CPU runtime: already host memory
    assert plan.move_of(find(plan, 0, "g"), "cpu", "cuda:0") is Move.TO_DEVICE


# ============================================================================ render


def test_render_shows_the_planned_moves() -> None:
    plan = make_plan(SPEC, PREFETCH_LAYER_1, EnvSnapshot(platform=GPU))
    (line,) = [ln for ln in render_plan(plan).splitlines() if ln.startswith("moves:")]
    assert line == (
        "moves:    3 parameters host -> device (150 B); 1 parameter meta -> new on device (300 B); "
        "2 parameters device -> host copy (600 B); 3 parameters host -> page-locked copy (150 B); "
        "1 parameter meta -> new host memory (300 B)"
    )


def test_render_has_no_moves_line_when_every_weight_is_in_place() -> None:
    on_device = ModelSpec(layers=tuple(
        LayerSpec(index=i, name=f"model.layers.{i}", params=(param("a", 64, "cuda:0"), param("b", 32, "cuda:0")))
        for i in range(2)
    ))
    plan = make_plan(on_device, OffloadConfig(backend="none"), EnvSnapshot(platform=GPU))
    assert moves_of(plan) == {Move.KEEP: (4, 2 * 128 + 2 * 64)}
    assert not [ln for ln in render_plan(plan).splitlines() if ln.startswith("moves:")]
