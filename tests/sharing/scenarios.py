"""What one member of a sharing group does in the tests, written once for both kinds of
members: threads of the test process (`tests.sharing.members`) and real processes
(`tests.sharing.workers`, over torch.distributed). Each returns a plain dict of what it
saw (JSON for processes), which the tests assert on.

`make` builds the member's offloader from its plan (``create_offloader(plan,
share_with=...)`` or `share_offloader` with a fake membership); `sync` waits for every
member (a barrier).
"""

from __future__ import annotations

import copy
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan
from offload.capture.smaps import segment_memory
from offload.protocols import Offloader
from offload.sharing import SharedOffloader
from tests.executors.helpers import assert_restored, cpu_plan, snapshot
from tests.executors.models import bits, layer_list, transformer_model

__all__ = ["CONFIGS", "HIDDEN_BIG", "Make", "Sync", "build", "engine", "expect_failure", "inputs_of", "parity", "reload",
           "shared", "untouched"]

#: Hidden size of the models whose memory is measured: large enough that slot padding
#: and page rounding are well under a percent of the bytes shared.
HIDDEN_BIG = 128

#: Plans by kind: prefetch of every layer (depth 2), and every weight on demand (the
#: UVA backend on a machine without CUDA).
CONFIGS = {
    "prefetch": OffloadConfig(group_size=1, num_in_group=1, prefetch_step=2),
    "prefetch-half": OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1),
    "uva": OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
}

Make = Callable[[OffloadPlan], Offloader]
Sync = Callable[[], None]

# ``torch.manual_seed`` is global: members that are threads build their models one at a time.
_BUILD = threading.Lock()


def build(layers: int, *, seed: int = 0, hidden: int = HIDDEN_BIG, meta: bool = False) -> nn.Sequential:
    """`transformer_model` (on the meta device with `meta`), safe to call from threads."""
    with _BUILD:
        if meta:
            with torch.device("meta"):
                return transformer_model(layers, seed=seed, hidden=hidden)
        return transformer_model(layers, seed=seed, hidden=hidden)


def shared(offloader: Offloader) -> SharedOffloader:
    """`offloader`, checked to be a `SharedOffloader`."""
    assert isinstance(offloader, SharedOffloader), type(offloader)
    return offloader


def inputs_of(seed: int, hidden: int, count: int = 3) -> Iterator[torch.Tensor]:
    """`count` activations (batch, tokens, hidden) of different sizes, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    for batch, tokens in ((2, 5), (1, 3), (3, 7))[:count]:
        yield torch.randn(batch, tokens, hidden, generator=generator)


def _in_segment(offloader: SharedOffloader, model: nn.Module) -> tuple[int, int]:
    """(offloaded weights whose real values, as state_dict gives them, lie in the
    segment; offloaded weights)."""
    segment = offloader.segment
    state = model.state_dict(keep_vars=False)
    names = {f"{p.layer}.{p.name}" for p in offloader.plan.offloaded_params}
    inside = sum(1 for n in names if segment is not None and segment.contains(state[n]))
    return inside, len(names)


def _restored(model: nn.Module, before: dict[str, Any]) -> str:
    """"" when every weight is back bit for bit (same Parameter objects), else why not."""
    try:
        assert_restored(model, before, same_storage=False)
    except AssertionError as exc:
        return f"not restored: {exc}"
    return ""


def _measure(offloader: SharedOffloader) -> dict[str, int]:
    segment = offloader.segment
    if segment is None:
        return {"mappings": 0, "size": 0, "rss": 0, "pss": 0}
    memory = segment_memory(segment.name)
    return {"mappings": memory.mappings, "size": memory.size_bytes, "rss": memory.rss_bytes, "pss": memory.pss_bytes}


def parity(rank: int, make: Make, sync: Sync, *, kind: str, layers: int = 4, hidden: int = HIDDEN_BIG,
           seed: int = 0, measure: bool = False) -> dict[str, Any]:
    """Offload a seeded transformer with sharing, run it against a resident copy, measure
    the segment's memory (after every member ran), restore; report what was seen."""
    model = build(layers, seed=seed, hidden=hidden)
    resident = copy.deepcopy(model)
    before = snapshot(model)
    plan = cpu_plan(model, CONFIGS[kind])
    off = shared(make(plan))
    started = time.monotonic()
    off.wrap_modules(layer_list(model))
    off.post_init()
    ready_s = time.monotonic() - started
    equal = [bool(torch.equal(model(x), resident(x))) for x in inputs_of(seed + 1, hidden)]
    inside, offloaded = _in_segment(off, model)
    name = off.segment.name if off.segment is not None else ""
    memory: dict[str, int] = {}
    if measure:
        sync()  # every member has run: every page is mapped by each
        memory = _measure(off)
        sync()  # nobody restores before everyone measured
    off.restore()
    restored = _restored(model, before)
    after = [bool(torch.equal(model(x), resident(x))) for x in inputs_of(seed + 1, hidden)]
    del off
    gc.collect()
    sync()  # members that are threads share one /proc/self/smaps: count after all restored
    left = segment_memory(name).mappings if name else 0
    return {"role": "", "equal": equal, "equal_after_restore": after, "in_segment": inside, "offloaded": offloaded,
            "segment": name, "host_bytes": plan.host_bytes, "memory": memory, "restored": restored,
            "mappings_after_restore": left, "ready_s": ready_s}


def engine(rank: int, make: Make, sync: Sync, *, kind: str, layers: int = 4, hidden: int = HIDDEN_BIG,
           seed: int = 0, measure: bool = False) -> dict[str, Any]:
    """The engine lifecycle: build on meta, plan, wrap, load every weight by name in
    place, post_init, run against a resident copy, restore."""
    model = build(layers, seed=seed, hidden=hidden, meta=True)
    weights = build(layers, seed=seed, hidden=hidden)
    plan = cpu_plan(model, CONFIGS[kind])
    off = shared(make(plan))
    off.wrap_modules(layer_list(model))
    for name, w in weights.state_dict().items():
        model.get_parameter(name).data.copy_(w)
    loaded_inside, _ = _in_segment(off, model)  # the leader's loader wrote the segment, followers' their own
    off.post_init()
    equal = [bool(torch.equal(model(x), weights(x))) for x in inputs_of(seed + 1, hidden)]
    inside, offloaded = _in_segment(off, model)
    memory: dict[str, int] = {}
    if measure:
        sync()
        memory = _measure(off)
        sync()
    off.restore()
    same = all(torch.equal(bits(p), bits(weights.get_parameter(n))) for n, p in model.named_parameters())
    return {"equal": equal, "loaded_in_segment": loaded_inside, "in_segment": inside, "offloaded": offloaded,
            "host_bytes": plan.host_bytes, "memory": memory, "restored_bits": same,
            "leader": off.sharing.role == "leader"}


def reload(rank: int, make: Make, sync: Sync, *, kind: str, layers: int = 4, hidden: int = HIDDEN_BIG,
           seed: int = 0) -> dict[str, Any]:
    """Offload with sharing and run; every member gives the model new weights with
    `load_weights` (a reload after an update); run against a resident model holding them,
    see where the real weights are, restore. ``model.load_state_dict`` is tried first,
    which a member of a sharing group refuses (the copy is shared)."""
    model = build(layers, seed=seed, hidden=hidden)
    fresh = build(layers, seed=seed + 7, hidden=hidden)
    plan = cpu_plan(model, CONFIGS[kind])
    off = shared(make(plan))
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs_of(seed + 1, hidden):
        model(x)  # the slots hold the old weights
    try:
        model.load_state_dict(fresh.state_dict())
        refused = ""
    except ExecutionError as exc:
        refused = str(exc)
    before_reload = [bool(torch.equal(model(x), fresh(x))) for x in inputs_of(seed + 2, hidden)]
    sync()  # every member ran with the old weights before the leader writes
    off.load_weights(fresh.state_dict())
    equal = [bool(torch.equal(model(x), fresh(x))) for x in inputs_of(seed + 3, hidden)]
    inside, offloaded = _in_segment(off, model)
    state = model.state_dict()
    state_equal = all(torch.equal(bits(state[n]), bits(t)) for n, t in fresh.state_dict().items())
    sync()  # nobody restores (and lets go of the segment) before every member ran
    off.restore()
    restored = all(torch.equal(bits(p), bits(fresh.get_parameter(n))) for n, p in model.named_parameters())
    return {"leader": off.sharing.role == "leader", "refused": refused, "before_reload": before_reload,
            "equal": equal, "in_segment": inside, "offloaded": offloaded, "state_equal": state_equal,
            "restored_bits": restored}


def untouched(model: nn.Module, before: dict[str, Any]) -> bool:
    """The model is exactly as it was (Parameters, bits, addresses)."""
    try:
        assert_restored(model, before, same_storage=True)
    except AssertionError:
        return False
    return True


def expect_failure(call: Callable[[], object]) -> tuple[str, float]:
    """(the ExecutionError's message, seconds until it came) from `call`, which must raise one."""
    start = time.monotonic()
    try:
        call()
    except ExecutionError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("no ExecutionError")
