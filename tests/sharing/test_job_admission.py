"""Host admission summed over the job: members as threads, sharing groups of
tensor-parallel ranks side by side in one job, host memory readings injected. Followers
are not refused for a private copy they do not take; a host whose processes together
do not fit is refused on every rank, at once, with the limit, the numbers and the ranks;
``host_check="warn"`` runs with one warning per process there; a member that fails at
``create_offloader`` makes every process of the job raise."""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from offload import EnvSnapshot, ExecutionError, OffloadPlan, Platform, WarningCode, describe_layers, make_plan
from offload.pure import HostCheck, HostFit
from offload.pure.sharing.plan import lay_out
from offload.sharing import SharedOffloader, ShareWith, render_sharing, share_offloader
from offload.sharing.coordinate import Membership
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE, on_compute_device, snapshot
from tests.executors.models import layer_list
from tests.sharing.jobs import run_job
from tests.sharing.members import run_members
from tests.sharing.scenarios import CONFIGS, build, expect_failure, inputs_of, shared, untouched

#: Seconds a member waits for another: generous; every failure here must come at once.
PATIENT_S = 10.0

#: The machine the plans are made for: CUDA (weights on the device, so a private copy
#: is all new host memory), registering in place, with 4 KiB of MemAvailable: every
#: plan's own, private-copy verdict is "does not fit".
TIGHT = attrs.evolve(CUDA_LIKE, host_pointer_for_registered_memory=True, host_available_bytes=4096)

#: Tensor parallelism 2 x data parallelism 2 on one host: ranks 0 and 2 hold one shard,
#: 1 and 3 the other; each pair shares a copy.
TP_GROUPS = [[0, 2], [1, 3]]


def device_plan(model: nn.Module, host_check: HostCheck = "refuse") -> OffloadPlan:
    config = attrs.evolve(CONFIGS["prefetch"], host_check=host_check)
    return make_plan(on_compute_device(describe_layers(layer_list(model))), config, EnvSnapshot(platform=TIGHT))


def segment_bytes(plan: OffloadPlan) -> int:
    """What a leader of `plan` takes: its segment (page-aligned slots: the plan pins)."""
    return lay_out(plan, mmap.PAGESIZE).total_bytes


def available(nbytes: int) -> Platform:
    """Host memory readings with `nbytes` of MemAvailable and no cgroup limit known."""
    return Platform(host_available_bytes=nbytes)


def run_model(off: SharedOffloader, model: nn.Module, resident: nn.Module) -> bool:
    """wrap, post_init, a forward against `resident`, restore: outputs equal."""
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = next(inputs_of(5, 32))
    equal = bool(torch.equal(model(x), resident(x)))
    off.restore()
    return equal


def test_a_follower_is_not_refused_for_a_private_copy_it_does_not_take() -> None:
    # Today's plans each say a private copy does not fit; with sharing, the host takes one
    # segment (the leader's) and nothing for the follower, which this machine has room for.
    def member(rank: int, m: Membership) -> tuple[HostFit, HostFit, bool, str]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        plan = device_plan(model)
        off = shared(share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S), membership=m))
        return plan.host_admission.verdict, off.plan.host_admission.verdict, run_model(off, model, resident), \
            off.plan.host_admission.message

    for own, shared_verdict, equal, message in (o.get() for o in run_members(2, member)):
        assert own is HostFit.DOES_NOT_FIT  # the private copy would not fit...
        assert shared_verdict is HostFit.FITS and equal  # ... and nobody is refused for it
        assert "for ranks 0, 1 on host" in message


def test_the_job_plan_counts_the_segment_on_the_leader_and_nothing_on_the_follower() -> None:
    def member(rank: int, m: Membership) -> tuple[int, int, int, Any]:
        model = build(2, hidden=32)
        plan = device_plan(model)
        off = shared(share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S), membership=m,
                                     host_memory=available(1 << 40)))
        job = off.sharing.job
        assert job is not None
        host = job.host_of(rank)
        assert host is not None
        me = host.process(rank)
        assert me is not None
        return me.new_bytes, off.plan.host_admission.host_bytes, segment_bytes(plan), host.needed_bytes

    (lead, lead_plan, segment, needed), (follow, follow_plan, _, needed_too) = (o.get() for o in run_members(2, member))
    assert (lead, follow) == (segment, 0) and (lead_plan, follow_plan) == (segment, 0)
    assert needed == needed_too == segment


def job_member(limit: Callable[[int, int], Platform], host_check: Callable[[int], HostCheck] = lambda r: "refuse",
               *, alone: bool = False) -> Callable[[int, Membership], dict[str, Any]]:
    """A member of a TP x DP job: its shard (seed) from its sharing group, host memory
    readings `limit(rank, segment bytes)`; what its wrap_modules did."""

    def member(rank: int, m: Membership) -> dict[str, Any]:
        model = build(2, hidden=32, seed=rank % 2)
        resident = build(2, hidden=32, seed=rank % 2)
        before = snapshot(model)
        plan = device_plan(model, host_check(rank))
        off = shared(share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S), membership=m,
                                     host_memory=limit(rank, segment_bytes(plan))))
        text = render_sharing(off.sharing)
        start = time.monotonic()
        try:
            equal = run_model(off, model, resident)
        except ExecutionError as exc:
            return {"error": exc, "seconds": time.monotonic() - start, "untouched": untouched(model, before),
                    "render": text, "segment": segment_bytes(plan), "role": off.sharing.role}
        return {"error": None, "equal": equal, "render": text, "plan": off.plan, "segment": segment_bytes(plan),
                "role": off.sharing.role}

    return member


def test_tensor_parallel_groups_on_one_host_are_summed_and_refused_on_every_rank() -> None:
    # Two copies (one per shard) on one host, and room for one and a half.
    results = [o.get() for o in run_job(TP_GROUPS, job_member(lambda rank, seg: available(seg * 3 // 2)))]
    assert [r["role"] for r in results] == ["leader", "leader", "follower", "follower"]
    segment = results[0]["segment"]
    messages = {str(r["error"]) for r in results}
    assert len(messages) == 1  # every rank fails the same way
    (message,) = messages
    assert message.startswith("refusing to offload on every rank of the job, nothing was moved")
    assert "ranks 0-3 on host" in message
    assert "rank 0" in message and "rank 1" in message and "writes a shared copy" in message
    assert "ranks 2, 3 none (they map a shared copy)" in message
    assert "only" in message and "is available (the host's MemAvailable)" in message
    for r in results:
        error = r["error"]
        assert isinstance(error, ExecutionError)
        assert error.name == "host_available" and error.value == (2 * segment, segment * 3 // 2)
        assert r["untouched"] and r["seconds"] < 1.0  # refused before anything moved, without waiting
        assert "does not fit on host" in r["render"] and "wrap_modules refuses it on every rank" in r["render"]


def test_tensor_parallel_groups_that_fit_together_run_bit_for_bit() -> None:
    results = [o.get() for o in run_job(TP_GROUPS, job_member(lambda rank, seg: available(seg * 5 // 2)))]
    for r in results:
        assert r["error"] is None and r["equal"], r
        plan = r["plan"]
        assert plan.host_admission.verdict is HostFit.FITS
        assert not [w for w in plan.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
        assert "job:      4 processes (ranks 0-3) on 1 host, host memory summed per host: fits" in r["render"]


def test_warn_runs_every_rank_with_one_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        results = [o.get() for o in run_job(TP_GROUPS, job_member(lambda rank, seg: available(seg * 3 // 2),
                                                                  lambda rank: "warn"))]
    assert all(r["error"] is None and r["equal"] for r in results), results
    records = [r.getMessage() for r in caplog.records if "host memory check (host_check='warn'" in r.getMessage()]
    assert len(records) == 4  # one per process, from its executor's admission
    assert all("for ranks 0-3 on host" in text and "is available" in text for text in records)
    for r in results:
        (warning,) = [w for w in r["plan"].warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
        assert "host_check='warn'" in warning.message and "ranks 0-3" in warning.message


def test_one_refusing_rank_refuses_for_the_whole_job() -> None:
    modes: Callable[[int], HostCheck] = lambda rank: "refuse" if rank == 3 else "warn"  # noqa: E731
    results = [o.get() for o in run_job(TP_GROUPS, job_member(lambda rank, seg: available(seg * 3 // 2), modes))]
    assert all(isinstance(r["error"], ExecutionError) and r["untouched"] for r in results)
    assert len({str(r["error"]) for r in results}) == 1


def test_off_runs_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        results = [o.get() for o in run_job(TP_GROUPS, job_member(lambda rank, seg: available(seg),
                                                                  lambda rank: "off"))]
    assert all(r["error"] is None and r["equal"] for r in results)
    assert not [r for r in caplog.records if "host memory check" in r.getMessage()]


def test_a_process_keeping_a_private_copy_counts_with_the_shared_one() -> None:
    # Ranks 0 and 1 share; rank 2 shares with nobody (a group of its own): its private
    # copy and the segment are on one host. Room for the segment and half a copy.
    def limit(rank: int, seg: int) -> Platform:
        return available(seg + seg // 2)

    def member(rank: int, m: Membership) -> tuple[str, str]:
        model = build(2, hidden=32)
        plan = device_plan(model)
        off = shared(share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S), membership=m,
                                     host_memory=limit(rank, segment_bytes(plan))))
        message, _ = expect_failure(lambda: off.wrap_modules(layer_list(model)))
        return off.sharing.role, message

    results = [o.get() for o in run_job([[0, 1], [2]], member)]
    assert [role for role, _ in results] == ["leader", "follower", "alone"]
    (message,) = {m for _, m in results}
    assert "ranks 0-2 on host" in message and "rank 2" in message and "(a private copy)" in message
    assert "rank 1 none (it maps a shared copy)" in message


def test_each_host_is_summed_on_its_own_and_a_host_that_does_not_fit_stops_the_job() -> None:
    hosts = [("node-1", "boot-1", "shm-1"), ("node-1", "boot-1", "shm-1"),
             ("node-2", "boot-2", "shm-2"), ("node-2", "boot-2", "shm-2")]

    def member(rank: int, m: Membership) -> tuple[str, str]:
        model = build(2, hidden=32)
        before = snapshot(model)
        plan = device_plan(model)
        seg = segment_bytes(plan)
        off = shared(share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S), membership=m,
                                     host_memory=available(seg if rank < 2 else seg - 1)))  # node-2 is short
        message, _ = expect_failure(lambda: off.wrap_modules(layer_list(model)))
        assert untouched(model, before)
        return message, render_sharing(off.sharing)

    results = [o.get() for o in run_job([[0, 1, 2, 3]], member, hosts=hosts)]
    (message,) = {m for m, _ in results}
    assert "ranks 2, 3 on host node-2" in message and "node-1" not in message
    text = results[0][1]
    assert "4 processes (ranks 0-3) on 2 hosts" in text and "does not fit on host node-2" in text
    assert "fits: ranks 0, 1 on host node-1" in text


def test_a_member_that_fails_at_create_makes_every_process_of_the_job_raise_at_once() -> None:
    # Rank 3's weights differ from rank 1's (their group refuses them); ranks 0 and 2,
    # another group, are waiting in the job's exchange and hear of it there.
    def member(rank: int, m: Membership) -> tuple[str, float]:
        model = build(2, hidden=32, seed=rank % 2)
        if rank == 3:
            weight = model.get_parameter("1.mlp.up.weight")
            weight.data = weight.data.double()
        plan = device_plan(model)
        return expect_failure(lambda: share_offloader(plan, FakeRuntime(), ShareWith(timeout_s=PATIENT_S),
                                                      membership=m, host_memory=available(1 << 40)))

    results = [o.get() for o in run_job(TP_GROUPS, member)]
    for rank in (1, 3):
        assert "the offloaded weights of rank 3 differ from rank 1's" in results[rank][0]
    for rank in (0, 2):
        message = results[rank][0]
        assert message.startswith("rank 1 failed creating its offloader (ExecutionError: refusing to share host")
        assert f"nothing was mapped on rank {rank}" in message
    assert all(seconds < PATIENT_S for _, seconds in results)
