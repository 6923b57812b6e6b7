"""New weights for a sharing group without restore (`load_weights` with shared
host copies): every member calls it; the leader writes the one copy once every follower
has stopped reading it, then every member refills its buffers; all compute bit for bit
as a resident model holding the new weights, and the weights stay in the one copy.
``model.load_state_dict`` is refused (the copy is shared: the others would not know)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from offload import ExecutionError
from offload.sharing import ShareWith, share_offloader
from offload.sharing.coordinate import Membership
from tests.executors.fakes import FakeRuntime, Sync
from tests.executors.helpers import cpu_plan
from tests.executors.models import layer_list
from tests.sharing.cluster import run_ranks
from tests.sharing.members import run_members
from tests.sharing.scenarios import CONFIGS, build, inputs_of, reload, shared
from tests.sharing.test_threads import PATIENT_S, barrier, maker


def _check(results: list[dict[str, Any]]) -> None:
    assert sum(r["leader"] for r in results) == 1
    for r in results:
        assert "shared read-only with other processes: call load_weights" in r["refused"], r["refused"]
        assert not any(r["before_reload"])  # the refused load_state_dict changed nothing
        assert all(r["equal"]) and r["state_equal"] and r["restored_bits"]
        assert r["in_segment"] == r["offloaded"] > 0  # the new weights are in the one copy


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_member_computes_with_the_new_weights_from_one_copy(kind: str, size: int) -> None:
    sync = barrier(size)
    _check([o.get() for o in run_members(size, lambda rank, m: reload(rank, maker(m), sync, kind=kind, hidden=32))])


def test_two_processes_reload_from_one_copy(tmp_path: Path) -> None:
    results = [r.result for r in run_ranks(2, "reload", tmp_path, kinds=["prefetch", "uva"])]
    for kind in ("prefetch", "uva"):
        _check([r[kind] for r in results])


def test_a_bad_name_on_the_leader_stops_its_followers_too() -> None:
    def member(rank: int, m: Membership) -> str:
        model = build(2, hidden=32)
        off = shared(maker(m)(cpu_plan(model, CONFIGS["prefetch"])))
        off.wrap_modules(layer_list(model))
        off.post_init()
        try:
            off.load_weights({"7.mlp.up.weight": model.get_parameter("0.mlp.up.weight").detach()})
        except ExecutionError as exc:
            return str(exc)
        finally:
            off.restore()
        return ""

    messages = [o.get() for o in run_members(2, member)]
    assert "is not <layer index>.<name in the layer> of the 2 wrapped layers" in messages[0]
    assert "rank 0, the leader on this host, failed load_weights" in messages[1]


def test_a_leader_that_fails_part_way_leaves_every_member_computing_with_what_it_wrote() -> None:
    """The leader wrote layer 1's new weights into the copy, then met a bad pair: it
    raises, and each follower refills its buffers from the copy before it raises too, so
    every member computes with what the copy holds (none with stale slots)."""
    fresh = build(3, seed=7, hidden=32)
    good = [(name, t) for name, t in fresh.state_dict().items() if name.startswith("1.")]
    expected = build(3, hidden=32)
    expected[1].load_state_dict({name.removeprefix("1."): t for name, t in good})
    x = next(inputs_of(4, 32))
    want = expected(x)

    def member(rank: int, m: Membership) -> tuple[str, bool]:
        model = build(3, hidden=32)
        off = shared(maker(m)(cpu_plan(model, CONFIGS["prefetch"])))
        off.wrap_modules(layer_list(model))
        off.post_init()
        model(x)  # the slots hold the old weights
        try:
            off.load_weights([*good, ("2.mlp.up.weight", model.get_parameter("0.mlp.up.bias").detach())])
            message = ""
        except ExecutionError as exc:
            message = str(exc)
        same = bool(torch.equal(model(x), want))
        off.restore()
        return message, same

    (leader, leader_same), (follower, follower_same) = [o.get() for o in run_members(2, member)]
    assert f"{len(good)} tensors were written before it" in leader
    assert "failed load_weights" in follower and "refilled its buffers" in follower
    assert leader_same and follower_same


def test_a_follower_waits_for_its_device_before_the_leader_writes() -> None:
    """A UVA follower's sync_prev_onload waits for nothing (no copy stream), yet its
    kernels may be reading the copy in place: load_weights waits for the device itself."""
    def member(rank: int, m: Membership) -> int:
        model = build(2, hidden=32)
        runtime = FakeRuntime()
        off = shared(share_offloader(cpu_plan(model, CONFIGS["uva"]), runtime, ShareWith(timeout_s=PATIENT_S),
                                     membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        before = len(runtime.log)
        off.load_weights(build(2, seed=3, hidden=32).state_dict())
        syncs = sum(isinstance(e, Sync) for e in runtime.log[before:])
        off.restore()
        return syncs

    leader_syncs, follower_syncs = [o.get() for o in run_members(2, member)]
    assert follower_syncs >= 2  # before saying it is quiet, and the executor's own before writing its part
    assert leader_syncs >= 1
