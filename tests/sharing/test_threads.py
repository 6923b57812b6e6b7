"""The sharing protocol with members as threads of this process (one in-process store,
a barrier for the gather): parity, the engine lifecycle, and what each failure does to
the others. Real processes, memory and kills are in `test_processes.py`."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
from typing import Any

import attrs
import pytest
import torch

from offload import (
    ConfigError,
    EnvSnapshot,
    ExecutionError,
    OffloadConfig,
    OffloadPlan,
    PlanError,
    describe_layers,
    make_plan,
)
from offload.protocols import Offloader
from offload.pure.decide.pinning import PinMethod
from offload.runtime.cpu import CpuRuntime
from offload.sharing import SharedOffloader, ShareWith, render_sharing, share_offloader
from offload.sharing.coordinate import Membership
from offload.sharing.pinning import (
    HOST_REGISTER_DEFAULT,
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    HOST_REGISTER_READ_ONLY,
)
from offload.sharing.segment import SHM_DIR
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE, cpu_plan, snapshot
from tests.executors.models import layer_list
from tests.sharing.fakes import FakePins
from tests.sharing.members import run_members
from tests.sharing.scenarios import (
    CONFIGS,
    Make,
    build,
    engine,
    expect_failure,
    inputs_of,
    parity,
    shared,
    untouched,
)

#: Seconds a member waits for another in the tests of timeouts running out.
TIMEOUT_S = 1.0
#: Seconds a member waits for another elsewhere: generous, so that a loaded machine cannot
#: fail a test whose members all answer (failures that are told must come well within).
PATIENT_S = 10.0


def maker(membership: Membership, *, verify: bool = True, shm_dir: str = SHM_DIR) -> Make:
    """Builds a member's offloader with the fake membership."""

    def make(plan: OffloadPlan) -> Offloader:
        return share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=PATIENT_S, verify=verify, shm_dir=shm_dir),
                               membership=membership)

    return make


def barrier(size: int) -> Any:
    sync = threading.Barrier(size)
    return lambda: sync.wait(10)


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-half", "uva"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_member_runs_bit_for_bit_from_one_copy_and_gets_its_weights_back(kind: str, size: int) -> None:
    sync = barrier(size)
    results = [o.get() for o in run_members(size, lambda rank, m: parity(rank, maker(m), sync, kind=kind,
                                                                              hidden=32))]
    names = {r["segment"] for r in results}
    assert len(names) == 1 and names != {""}  # one segment, mapped by all
    for r in results:
        assert all(r["equal"]) and all(r["equal_after_restore"])
        assert r["in_segment"] == r["offloaded"] > 0  # every host copy lies in the segment
        assert r["restored"] == ""
        assert r["mappings_after_restore"] == 0


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_engine_lifecycle_followers_private_copies_move_into_the_segment_at_post_init(kind: str) -> None:
    sync = barrier(3)
    results = [o.get() for o in run_members(3, lambda rank, m: engine(rank, maker(m), sync, kind=kind, hidden=32))]
    for r in results:
        assert all(r["equal"]) and r["restored_bits"]
        assert r["in_segment"] == r["offloaded"] > 0
        # Before post_init the leader's loader wrote the segment itself; followers loaded private memory.
        assert r["loaded_in_segment"] == (r["offloaded"] if r["leader"] else 0)


def test_a_follower_that_skips_loading_gets_the_leaders_weights_when_verify_is_off() -> None:
    def member(rank: int, m: Membership) -> bool:
        model = build(2, hidden=32, meta=True)
        weights = build(2, hidden=32)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                              ShareWith(timeout_s=PATIENT_S, verify=False), membership=m)
        off.wrap_modules(layer_list(model))
        if rank == 0:  # only the leader loads
            for name, w in weights.state_dict().items():
                model.get_parameter(name).data.copy_(w)
        else:  # resident weights are the follower's own business
            for name, w in weights.state_dict().items():
                if not any(f"{p.layer}.{p.name}" == name for p in off.plan.offloaded_params):
                    model.get_parameter(name).data.copy_(w)
        off.post_init()
        x = next(inputs_of(3, 32))
        equal = bool(torch.equal(model(x), weights(x)))
        off.restore()
        return equal

    assert [o.get() for o in run_members(2, member)] == [True, True]


def test_followers_map_read_only_the_leader_read_write() -> None:
    def member(rank: int, m: Membership) -> str:
        model = build(2, hidden=32)
        off = shared(share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                     ShareWith(timeout_s=PATIENT_S), membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        segment = off.segment
        assert segment is not None
        with open("/proc/self/maps") as f:  # both mappings are in this process: find this member's by address
            perms = next(line.split()[1] for line in f
                         if int(line.split("-")[0], 16) == segment.base and segment.name in line)
        off.restore()
        return perms

    assert [o.get() for o in run_members(2, member)] == ["rw-s", "r--s"]


def test_the_sharing_plan_says_who_writes_and_what_is_saved() -> None:
    def member(rank: int, m: Membership) -> SharedOffloader:
        model = build(2, hidden=32)
        return shared(share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                      ShareWith(timeout_s=PATIENT_S), membership=m))

    offloaders = [o.get() for o in run_members(4, member)]
    plans = [o.sharing for o in offloaders]
    assert [p.role for p in plans] == ["leader", "follower", "follower", "follower"]
    assert {p.leader for p in plans} == {0} and {p.local.ranks for p in plans} == {(0, 1, 2, 3)}
    p = plans[2]
    assert p.shared and p.segment_bytes >= p.host_bytes > 0
    assert p.host_bytes_per_host == p.segment_bytes
    assert p.host_bytes_unshared_per_host == 4 * p.host_bytes
    assert p.host_bytes_per_process == p.segment_bytes // 4
    text = render_sharing(p)
    assert "ranks 0-3" in text and "written by rank 0" in text and "this is rank 2, a follower" in text
    assert "instead of 4 x" in text and f"timeout:  {PATIENT_S:g} s" in text


def test_a_member_alone_on_its_host_does_not_share_and_runs_as_usual() -> None:
    def member(rank: int, m: Membership) -> tuple[str, bool]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        off = shared(share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                     ShareWith(timeout_s=PATIENT_S), membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs_of(1, 32))
        equal = bool(torch.equal(model(x), resident(x))) and off.segment is None
        off.restore()
        return render_sharing(off.sharing), equal

    text, equal = run_members(1, member)[0].get()
    assert equal and "only member" in text and "not shared" in text


def test_a_noop_plan_shares_nothing() -> None:
    def member(rank: int, m: Membership) -> tuple[bool, str]:
        model = build(2, hidden=32)
        off = shared(share_offloader(cpu_plan(model, OffloadConfig(backend="none")), CpuRuntime(),
                                     ShareWith(timeout_s=PATIENT_S), membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        off.restore()
        return off.sharing.shared, off.sharing.reason

    assert [o.get() for o in run_members(2, member)] == [(False, "nothing is offloaded to host memory")] * 2


# ---- failures ---------------------------------------------------------------------------


def test_mismatched_weights_are_refused_on_every_member_by_rank_and_parameter() -> None:
    def member(rank: int, m: Membership) -> str:
        model = build(3, hidden=32)
        if rank == 2:
            weight = model.get_parameter("1.mlp.up.weight")
            weight.data = weight.data.double()
        plan = cpu_plan(model, CONFIGS["prefetch"])
        return expect_failure(lambda: share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                                                      membership=m))[0]

    messages = [o.get() for o in run_members(3, member)]
    assert len(set(messages)) == 1  # every member says the same
    assert "rank 2 differ from rank 0's" in messages[0]
    assert "layer 1 parameter 'mlp.up.weight'" in messages[0] and "float64" in messages[0]
    assert "nothing was mapped" in messages[0]


def test_a_member_offloading_other_layers_is_refused_by_name() -> None:
    def member(rank: int, m: Membership) -> str:
        model = build(2, hidden=32)
        config = CONFIGS["prefetch"] if rank == 0 else OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1)
        plan = cpu_plan(model, config)
        return expect_failure(lambda: share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                                                      membership=m))[0]

    message = run_members(2, member)[1].get()
    assert "rank 1 differ from rank 0's" in message
    assert "offloaded parameter #0: rank 0 has layer 0 parameter 'attn.norm.weight'" in message
    assert "rank 1 has layer 1 parameter 'attn.norm.weight'" in message


def test_same_shapes_other_values_a_tensor_parallel_mistake_is_refused_on_every_member() -> None:
    def member(rank: int, m: Membership) -> tuple[str, bool]:
        model = build(2, hidden=32, seed=rank)  # same shapes, different values
        before = snapshot(model)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                              membership=m)
        message, _ = expect_failure(lambda: off.wrap_modules(layer_list(model)))
        return message, untouched(model, before)

    (leader, _), (follower, same) = (o.get() for o in run_members(2, member))
    for message in (leader, follower):  # the leader does not run on (tests/sharing/test_verdict.py: the rest)
        assert "rank 1's weights differ from the shared host copy rank 0 wrote" in message
        assert "tensor-parallel" in message and "layer 0 parameter" in message
    assert same  # the follower's model is as it was, addresses included


def test_the_leader_failing_before_publishing_makes_followers_raise_at_once() -> None:
    def member(rank: int, m: Membership) -> tuple[str, float, bool]:
        model = build(2, hidden=32)
        before = snapshot(model)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                              membership=m)
        if rank == 0:
            with pytest.raises(PlanError, match="the plan is for 2 layers, got 1"):
                off.wrap_modules(layer_list(model)[:1])
            return "", 0.0, untouched(model, before)
        message, seconds = expect_failure(lambda: off.wrap_modules(layer_list(model)))
        return message, seconds, untouched(model, before)

    outcomes = [o.get() for o in run_members(3, member)]
    for message, seconds, same in outcomes[1:]:
        assert "rank 0, the leader on this host, failed writing the shared host copy" in message
        assert "the plan is for 2 layers" in message and "nothing was moved" in message
        assert seconds < PATIENT_S  # told, not timed out
        assert same
    assert outcomes[0][2]


def test_a_leader_that_never_publishes_makes_followers_raise_within_the_timeout() -> None:
    def member(rank: int, m: Membership) -> tuple[str, float]:
        model = build(2, hidden=32)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=TIMEOUT_S),
                              membership=m)
        if rank == 0:
            return "", 0.0  # never wraps
        return expect_failure(lambda: off.wrap_modules(layer_list(model)))

    for message, seconds in [o.get() for o in run_members(2, member)][1:]:
        assert "waited" in message and "for rank 0 to create the shared host copy" in message
        assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 3


def test_a_follower_that_never_maps_makes_the_leader_raise_and_remove_the_segment() -> None:
    def member(rank: int, m: Membership) -> tuple[str, float, bool]:
        model = build(2, hidden=32)
        before = snapshot(model)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=TIMEOUT_S),
                              membership=m)
        if rank == 2:
            return "", 0.0, True  # never wraps
        message, seconds = expect_failure(lambda: off.wrap_modules(layer_list(model)))
        return message, seconds, untouched(model, before)

    (leader, seconds, same), (follower, _, follower_same), _ = (o.get() for o in run_members(3, member))
    assert "for rank 2 to map the shared host copy" in leader and seconds < TIMEOUT_S + 3
    assert same and follower_same
    assert "rank 0, the leader on this host, failed writing" in follower  # told by the leader


def test_members_that_see_different_shared_memory_do_not_share(tmp_path: Any) -> None:
    def member(rank: int, m: Membership) -> tuple[bool, bool]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        shm = str(tmp_path) if rank == 1 else SHM_DIR  # another file system: as a container with its own /dev/shm
        off = shared(share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                     ShareWith(timeout_s=PATIENT_S, shm_dir=shm), membership=m))
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs_of(1, 32))
        equal = bool(torch.equal(model(x), resident(x)))
        off.restore()
        return off.sharing.shared, equal

    assert [o.get() for o in run_members(2, member)] == [(False, True), (False, True)]


def test_a_follower_that_cannot_map_tells_the_leader_at_once() -> None:
    # Two directories on the one /dev/shm file system: the members count as one host, and
    # the follower looks for the segment where it is not (as a wrong IPC namespace would).
    dirs = [tempfile.mkdtemp(prefix="sharing-test-", dir=SHM_DIR) for _ in range(2)]
    try:
        def member(rank: int, m: Membership) -> tuple[str, float]:
            model = build(2, hidden=32)
            off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(),
                                  ShareWith(timeout_s=PATIENT_S, shm_dir=dirs[rank]), membership=m)
            return expect_failure(lambda: off.wrap_modules(layer_list(model)))

        (leader, seconds), (follower, _) = (o.get() for o in run_members(2, member))
        assert all(os.listdir(d) == [] for d in dirs)  # the leader removed its segment
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert "rank 1 could not map the shared host copy" in leader and "cannot open" in leader
    assert seconds < PATIENT_S
    assert "one IPC namespace" in follower


def test_the_leaders_post_init_failing_makes_followers_raise_and_keeps_their_weights() -> None:
    def member(rank: int, m: Membership) -> tuple[str, bool]:
        model = build(2, hidden=32, meta=True)
        weights = build(2, hidden=32)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                              membership=m)
        off.wrap_modules(layer_list(model))
        for name, w in weights.state_dict().items():
            model.get_parameter(name).data.copy_(w)
        if rank == 0:
            off.post_init()
            with pytest.raises(ExecutionError, match="post_init needs wrap_modules first and runs once"):
                off.post_init()  # the second call fails: the follower's second call hears of it
            off.restore()
            return "", True
        off.post_init()
        message, _ = expect_failure(off.post_init)
        x = next(inputs_of(2, 32))
        still = bool(torch.equal(model(x), weights(x)))
        off.restore()
        return message, still

    _, (message, still) = (o.get() for o in run_members(2, member))
    assert "rank 0, the leader on this host, failed post_init" in message
    assert "weights left in host memory" in message and still



def test_members_on_two_hosts_share_one_copy_per_host() -> None:
    hosts = [("node-1", "boot-1", "shm-1")] * 2 + [("node-2", "boot-2", "shm-2")] * 2
    sync = barrier(4)
    outcomes = run_members(4, lambda rank, m: parity(rank, maker(m), sync, kind="prefetch", hidden=32), hosts=hosts)
    results = [o.get() for o in outcomes]
    segments = [r["segment"] for r in results]
    assert segments[0] == segments[1] != segments[2] == segments[3]  # one per host, each written by its lowest rank
    for r in results:
        assert all(r["equal"]) and r["in_segment"] == r["offloaded"] and r["restored"] == ""


def test_a_pinned_plan_registers_each_slot_once_read_only_on_followers() -> None:
    platform = attrs.evolve(CUDA_LIKE, host_pointer_for_registered_memory=True)
    pins = FakePins()
    lock = threading.Lock()

    def member(rank: int, m: Membership) -> tuple[bool, str, str]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        plan = make_plan(describe_layers(layer_list(model)), CONFIGS["prefetch"], EnvSnapshot(platform=platform))
        assert plan.pin.method is PinMethod.REGISTER
        with lock:
            calls = pins.calls()
        off = shared(share_offloader(plan, FakeRuntime(device="cuda:0"), ShareWith(timeout_s=PATIENT_S),
                                     membership=m, pin_calls=calls))
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs_of(4, 32))
        equal = bool(torch.equal(model(x), resident(x)))
        segment = off.segment
        assert segment is not None
        base, end = segment.base, segment.base + segment.nbytes
        off.restore()
        flags = {f for p, _, f in pins.registered if base <= p < end}
        return equal and all(p % mmap.PAGESIZE == 0 for p, _, _ in pins.registered), off.sharing.role, str(flags)

    results = [o.get() for o in run_members(2, member)]
    # Followers: read-only, and mapped and portable explicitly (the CUDA documentation
    # promises those under unified addressing only for the default flags).
    follower = HOST_REGISTER_READ_ONLY | HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE
    assert follower == 0x0B
    assert results == [(True, "leader", str({HOST_REGISTER_DEFAULT})), (True, "follower", str({follower}))]
    assert sorted(pins.unregistered) == sorted(p for p, _, _ in pins.registered)  # all undone by restore


def test_members_that_retry_a_failed_wrap_together_meet_afresh() -> None:
    def member(rank: int, m: Membership) -> tuple[str, bool]:
        model = build(2, hidden=32)
        resident = build(2, hidden=32)
        off = share_offloader(cpu_plan(model, CONFIGS["prefetch"]), CpuRuntime(), ShareWith(timeout_s=PATIENT_S),
                              membership=m)
        layers = layer_list(model)
        first = ""
        try:
            off.wrap_modules(layers[:1] if rank == 0 else layers)  # the leader's first try fails
        except (ExecutionError, PlanError) as exc:
            first = str(exc)
        off.wrap_modules(layers)
        off.post_init()
        x = next(inputs_of(6, 32))
        equal = bool(torch.equal(model(x), resident(x)))
        off.restore()
        return first, equal

    (leader, leader_ok), (follower, follower_ok) = (o.get() for o in run_members(2, member))
    assert "the plan is for 2 layers" in leader and "failed writing the shared host copy" in follower
    assert leader_ok and follower_ok


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout: float) -> None:
    with pytest.raises(ConfigError, match="timeout_s must be a positive number of seconds"):
        ShareWith(timeout_s=timeout)
