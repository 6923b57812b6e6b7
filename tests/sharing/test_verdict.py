"""A follower whose values differ from its leader's copy (the shapes equal, so that the
fingerprints agree: tensor-parallel ranks put in one data-parallel group) stops the whole
sharing group: every member, on every host, raises `ExecutionError` naming the ranks
whose values differ and the first weight, at the call where the follower found it
(``wrap_modules`` for weights with data, ``post_init`` for weights loaded after wrap), and
each model is left as that failed call leaves it. Members as threads of this process."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
from typing import Any

import pytest
import torch
from torch.distributed.distributed_c10d import PrefixStore

from offload import ExecutionError
from offload.capture.smaps import segment_memory
from offload.pure.sharing.plan import MemberInfo, describe_differences, plan_sharing
from offload.runtime.cpu import CpuRuntime
from offload.sharing import ShareWith, share_offloader
from offload.sharing.coordinate import Membership
from offload.sharing.segment import SHM_DIR
from tests.executors.helpers import assert_restored, cpu_plan, patched_layers, snapshot
from tests.executors.models import bits, layer_list
from tests.sharing.members import ThreadGroup, run_members, run_threads
from tests.sharing.scenarios import CONFIGS, build, inputs_of, shared, untouched

#: Seconds a member waits for another: generous, every failure here must come at once.
PATIENT_S = 10.0

#: Two hosts of two members each (each host has its own leader: ranks 0 and 2).
TWO_HOSTS = [("node-1", "boot-1", "shm-1")] * 2 + [("node-2", "boot-2", "shm-2")] * 2
#: Three members on one host, a fourth alone on another (it shares with nobody).
ONE_ALONE = [("node-1", "boot-1", "shm-1")] * 3 + [("node-2", "boot-2", "shm-2")]


def refused(call: Any) -> tuple[ExecutionError, float]:
    """(the ExecutionError `call` raised, seconds until it came); it must raise one."""
    start = time.monotonic()
    try:
        call()
    except ExecutionError as exc:
        return exc, time.monotonic() - start
    raise AssertionError("no ExecutionError")


def restored(model: torch.nn.Module, before: dict[str, Any]) -> str:
    """"" when every weight is back bit for bit (the same Parameter objects), else why not."""
    try:
        assert_restored(model, before, same_storage=False)
    except AssertionError as exc:
        return f"not restored: {exc}"
    return ""


def assert_names(exc: ExecutionError, bad: int, leader: int) -> None:
    """`exc` refuses the group for rank `bad`'s values, against `leader`'s copy, by weight."""
    text = str(exc)
    assert exc.name == "share_with" and exc.value == (bad,), (exc.value, text)
    assert f"rank {bad}'s weights differ from the shared host copy rank {leader} wrote" in text, text
    assert "layer 0 parameter 'attn.qkv.weight'" in text, text  # the first weight that differs (norms are ones)
    assert "tensor-parallel" in text and "every member of the sharing group" in text, text


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_other_values_at_wrap_stop_every_member_and_move_nothing(kind: str) -> None:
    def member(rank: int, m: Membership) -> dict[str, Any]:
        model = build(2, hidden=32, seed=1 if rank == 2 else 0)
        before = snapshot(model)
        off = shared(share_offloader(cpu_plan(model, CONFIGS[kind]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                                     membership=m))
        layers = layer_list(model)
        exc, seconds = refused(lambda: off.wrap_modules(layers))
        return {"exc": exc, "seconds": seconds, "untouched": untouched(model, before),
                "restored": restored(model, before), "hooks": patched_layers(layers), "segment": off.segment}

    results = [o.get() for o in run_members(3, member)]
    for rank, r in enumerate(results):
        assert_names(r["exc"], bad=2, leader=0)
        assert r["seconds"] < PATIENT_S  # told, not timed out
        assert r["restored"] == "" and r["hooks"] == [] and r["segment"] is None, rank
    assert all(f"rank {rank}'s model is left as it was" in str(r["exc"]) for rank, r in enumerate(results))
    # Followers moved nothing at all: their weights are where they were, at the same addresses.
    assert results[1]["untouched"] and results[2]["untouched"]


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_other_values_loaded_after_wrap_stop_every_member_at_post_init_and_restore_gives_them_back(
        kind: str) -> None:
    def member(rank: int, m: Membership) -> dict[str, Any]:
        model = build(2, hidden=32, meta=True)
        weights = build(2, hidden=32, seed=1 if rank == 1 else 0)
        off = shared(share_offloader(cpu_plan(model, CONFIGS[kind]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                                     membership=m))
        off.wrap_modules(layer_list(model))
        for name, w in weights.state_dict().items():
            model.get_parameter(name).data.copy_(w)
        exc, seconds = refused(off.post_init)
        segment = off.segment
        state = model.state_dict()
        inside = sum(1 for p in off.plan.offloaded_params
                     if segment is not None and segment.contains(state[f"{p.layer}.{p.name}"]))
        off.restore()
        same = all(torch.equal(bits(p), bits(weights.get_parameter(n))) for n, p in model.named_parameters())
        return {"exc": exc, "seconds": seconds, "inside": inside, "same": same, "role": off.sharing.role}

    results = [o.get() for o in run_members(3, member)]
    assert [r["role"] for r in results] == ["leader", "follower", "follower"]
    for r in results:
        assert_names(r["exc"], bad=1, leader=0)
        assert "weights left in host memory" in str(r["exc"])
        assert r["seconds"] < PATIENT_S and r["same"]  # restore gives back each member's own weights
    assert results[1]["inside"] == results[2]["inside"] == 0  # no follower pointed a weight at the copy


@pytest.mark.parametrize(("hosts", "bad", "leader"), [(TWO_HOSTS, 3, 2), (ONE_ALONE, 1, 0)],
                         ids=["two-hosts", "one-alone"])
def test_other_values_on_one_host_stop_the_members_on_every_host(hosts: list[tuple[str, str, str]], bad: int,
                                                                 leader: int) -> None:
    def member(rank: int, m: Membership) -> tuple[ExecutionError, float, str]:
        model = build(2, hidden=32, seed=1 if rank == bad else 0)
        before = snapshot(model)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                              membership=m)
        exc, seconds = refused(lambda: off.wrap_modules(layer_list(model)))
        return exc, seconds, restored(model, before)

    for exc, seconds, back in [o.get() for o in run_members(4, member, hosts=hosts)]:
        assert_names(exc, bad=bad, leader=leader)
        assert seconds < PATIENT_S and back == ""


def test_followers_that_do_not_verify_publish_nothing_and_the_others_still_check() -> None:
    # Rank 1 does not verify (and holds other values: it gets the leader's); rank 2 verifies
    # and matches: the group runs, every member with the leader's weights.
    def member(rank: int, m: Membership) -> tuple[tuple[int, ...], bool]:
        model = build(2, hidden=32, seed=1 if rank == 1 else 0)
        leaders = build(2, hidden=32)
        off = shared(share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                     ShareWith(timeout_s=PATIENT_S, verify=rank != 1), membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs_of(3, 32))
        equal = bool(torch.equal(model(x), leaders(x)))
        off.restore()
        return off.sharing.verifiers, equal

    assert [o.get() for o in run_members(3, member)] == [((2,), True)] * 3


def test_a_follower_failing_at_wrap_makes_the_members_on_other_hosts_raise_at_once() -> None:
    # Rank 1 looks for its leader's segment where it is not: it fails and says so; rank 0
    # hears of it from its follower, ranks 2 and 3 (another host) from its verdict.
    dirs = [tempfile.mkdtemp(prefix="sharing-test-", dir=SHM_DIR) for _ in range(2)]
    try:
        def member(rank: int, m: Membership) -> tuple[ExecutionError, float, str]:
            model = build(2, hidden=32)
            before = snapshot(model)
            shm = dirs[rank] if rank < 2 else SHM_DIR
            off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                  ShareWith(timeout_s=PATIENT_S, shm_dir=shm), membership=m)
            exc, seconds = refused(lambda: off.wrap_modules(layer_list(model)))
            return exc, seconds, restored(model, before)

        results = [o.get() for o in run_members(4, member, hosts=TWO_HOSTS)]
        assert all(os.listdir(d) == [] for d in dirs)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert "rank 1 could not map the shared host copy" in str(results[0][0])
    for exc, seconds, back in results[2:]:
        assert exc.value == (1,) and "rank 1 failed wrap_modules" in str(exc), str(exc)
        assert seconds < PATIENT_S and back == ""


def test_a_follower_on_another_host_that_never_wraps_makes_the_others_raise_within_two_timeouts() -> None:
    timeout_s = 1.0

    def member(rank: int, m: Membership) -> tuple[ExecutionError, float, str] | None:
        model = build(2, hidden=32)
        before = snapshot(model)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=timeout_s),
                              membership=m)
        if rank == 3:
            return None  # never wraps
        exc, seconds = refused(lambda: off.wrap_modules(layer_list(model)))
        return exc, seconds, restored(model, before)

    results = [o.get() for o in run_members(4, member, hosts=TWO_HOSTS)]
    for outcome in results[:2]:  # the other host: its verdicts are in, rank 3's never comes
        assert outcome is not None
        exc, seconds, back = outcome
        assert exc.value == (3,) and "for rank 3 to compare its weights" in str(exc), str(exc)
        assert seconds < 2 * timeout_s + 3 and back == ""
    third = results[2]
    assert third is not None and "for rank 3 to map the shared host copy" in str(third[0])


def test_the_verifiers_are_the_followers_of_every_host_that_verify() -> None:
    def info(rank: int, host: str, verify: bool = True, seg: int = 100) -> MemberInfo:
        return MemberInfo(rank=rank, host=host, boot_id="b", shm_id="s", pid=rank, session="s", digest="d",
                          storages=1, host_bytes=seg, segment_bytes=seg, verify=verify)

    group = [info(0, "a"), info(1, "a"), info(2, "a", verify=False), info(3, "b"), info(4, "c"), info(5, "c")]
    assert {plan_sharing(group, r, timeout_s=1).verifiers for r in range(6)} == {(1, 5)}  # the same on every member
    nothing = [info(r, "a", seg=0) for r in range(3)]  # nothing offloaded: nothing shared, nothing compared
    assert plan_sharing(nothing, 1, timeout_s=1).verifiers == ()


def test_more_than_three_differing_ranks_are_counted() -> None:
    differ = [(r, 0, (0, "w"), 1 + r) for r in range(1, 6)]
    text = describe_differences(differ, "post_init", "left")
    assert "rank 1's weights differ from the shared host copy rank 0 wrote (layer 0 parameter 'w', and 1 more" in text
    assert "rank 3's" in text and "rank 4's" not in text and "and those of 2 more ranks" in text
    assert text.startswith("refusing post_init on every member") and text.endswith("; left")


def test_a_refused_wrap_leaves_no_weight_over_the_segment() -> None:
    # The leader's executor moved its weights into the segment; putting them back must
    # give them private memory again, as restore() does: nothing maps the segment after.
    group = ThreadGroup(3)

    def member(rank: int) -> tuple[torch.nn.Module, str]:
        model = build(2, hidden=32, seed=1 if rank == 2 else 0)
        off = shared(share_offloader(cpu_plan(model, CONFIGS["uva"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                                     membership=group.membership(rank)))
        refused(lambda: off.wrap_modules(layer_list(model)))
        keys = PrefixStore(f"offload-share/{off.sharing.session}/0/", group.store)  # the leader's Channel
        published = json.loads(keys.get("wrap0/segment"))
        return model, str(published["name"])

    results = [o.get() for o in run_threads(3, member)]
    gc.collect()
    (name,) = {n for _, n in results}
    assert segment_memory(name).mappings == 0  # the models are alive, and none of their weights maps it
    for (model, _), rank in zip(results, range(3), strict=True):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), build(2, hidden=32, seed=int(rank == 2))
                                                     .parameters(), strict=True))
