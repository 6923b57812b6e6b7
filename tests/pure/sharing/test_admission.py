"""The pure side of the job's host admission (`offload.pure.sharing.admission`): what each
process takes by its role, the sums per machine and per container against their limits,
the verdict every process computes alike, and the plan its executor obeys."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from offload import EnvSnapshot, OffloadConfig, WarningCode, describe_layers, make_plan
from offload.pure import CgroupMemory, HostCheck, HostFit, HostLimit
from offload.pure.decide.admission import HostAdmission, LimitCheck
from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.admission import assess_job, job_plan, local_admission
from offload.pure.sharing.memory import ProcessMemory, private_host_bytes, process_host_bytes
from offload.pure.sharing.plan import HostShare, SharingPlan
from offload.pure.sharing.render import render_sharing
from tests.executors.helpers import CUDA_LIKE, on_compute_device
from tests.executors.models import layer_list, transformer_model

GIB = 1 << 30
PREFETCH = OffloadConfig(group_size=1, num_in_group=1, prefetch_step=2)


def proc(rank: int, role: str = "leader", new: int = 0, *, host: str = "n1", boot: str = "b1", shm: str = "s1",
         avail: int | None = None, cgroup: CgroupMemory | None = None, mode: str = "refuse", private: int = 0,
         error: str = "") -> ProcessMemory:
    return ProcessMemory(rank=rank, host=host, boot_id=boot, shm_id=shm, role=role, new_bytes=new,
                         private_bytes=private, available_bytes=avail, cgroup=cgroup or CgroupMemory(),
                         host_check=mode, error=error)


def limited(limit: int, used: int, where: str) -> CgroupMemory:
    return CgroupMemory(version=2, limit_bytes=limit, current_bytes=used, limit_path=f"/sys/fs/cgroup/{where}/memory.max",
                        cgroup_path=f"/{where}")


def tp_job(avail: int | None, mode: str = "refuse") -> list[ProcessMemory]:
    """TP 2 x DP 2 on one host: leaders 0 and 1 write a 10 GiB copy each; 2 and 3 map them."""
    return [proc(0, "leader", 10 * GIB, avail=avail, mode=mode), proc(1, "leader", 10 * GIB, avail=avail, mode=mode),
            proc(2, "follower", avail=avail, mode=mode), proc(3, "follower", avail=avail, mode=mode)]


# ---- what one process takes ---------------------------------------------------------------


def test_a_leader_takes_its_segment_a_follower_nothing_and_a_lone_process_its_private_copy() -> None:
    model = transformer_model(2, hidden=32)
    plan = make_plan(on_compute_device(describe_layers(layer_list(model))), PREFETCH, EnvSnapshot(platform=CUDA_LIKE))
    assert plan.compute_device == "cuda" and plan.host_bytes > 0
    assert private_host_bytes(plan) == plan.host_bytes  # weights on the device: all of it new
    assert process_host_bytes(plan, "leader", 12345) == 12345
    assert process_host_bytes(plan, "follower", 12345) == 0
    assert process_host_bytes(plan, "alone", 12345) == plan.host_bytes


def test_on_the_cpu_every_process_adds_its_buffers_and_a_follower_its_weights_on_meta() -> None:
    model = transformer_model(2, hidden=32)
    plan = make_plan(describe_layers(layer_list(model)), PREFETCH, EnvSnapshot())
    buffers = plan.device_bytes_buffers
    assert plan.compute_device == "cpu" and buffers > 0
    assert private_host_bytes(plan) == buffers  # weights already in host memory are adopted
    assert process_host_bytes(plan, "leader", 1000) == 1000 + buffers
    assert process_host_bytes(plan, "follower", 1000) == buffers
    meta = make_plan(describe_layers(layer_list(_meta_model())), PREFETCH, EnvSnapshot())
    owners = sum(p.nbytes for p in meta.offloaded_params if p.tied_to is None)
    assert process_host_bytes(meta, "follower", 1000) == owners + meta.device_bytes_buffers  # its loader's memory
    with pytest.raises(ValueError, match="role must be one of"):
        process_host_bytes(plan, "observer", 0)


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return transformer_model(2, hidden=32)


# ---- the job's verdict ---------------------------------------------------------------------


def test_two_sharing_groups_on_one_host_need_two_copies() -> None:
    job = assess_job(tp_job(avail=15 * GIB))
    (host,) = job.hosts
    assert host.ranks == (0, 1, 2, 3) and host.needed_bytes == 20 * GIB
    assert host.verdict is HostFit.DOES_NOT_FIT and host.refused and job.refused is host
    assert host.binding is not None and host.binding.check.limit is HostLimit.HOST_AVAILABLE
    assert (host.binding.check.needed_bytes, host.binding.check.allowed_bytes) == (20 * GIB, 15 * GIB)
    assert host.message == (
        "ranks 0-3 on host n1 need 20.00 GiB of new host memory (rank 0 10.00 GiB (writes a shared copy), "
        "rank 1 10.00 GiB (writes a shared copy); ranks 2, 3 none (they map a shared copy)); only 15.00 GiB is "
        "available (the host's MemAvailable)")
    assert assess_job(tp_job(avail=20 * GIB)).hosts[0].verdict is HostFit.FITS


@pytest.mark.parametrize(("modes", "refused"), [
    (["refuse"] * 4, True),
    (["warn"] * 4, False),
    (["off"] * 4, False),
    (["warn", "warn", "warn", "refuse"], True),  # any process there that refuses refuses it
    (["off", "warn", "off", "warn"], False),
])
def test_a_host_that_does_not_fit_is_refused_when_a_process_there_says_refuse(modes: list[str], refused: bool) -> None:
    processes = [attrs.evolve(p, host_check=m) for p, m in zip(tp_job(avail=GIB), modes, strict=True)]
    job = assess_job(processes)
    assert job.hosts[0].verdict is HostFit.DOES_NOT_FIT
    assert job.hosts[0].refused is refused and (job.refused is not None) is refused


def test_private_copies_count_beside_the_shared_one() -> None:
    processes = [proc(0, "leader", 10 * GIB, avail=14 * GIB, private=10 * GIB),
                 proc(1, "follower", avail=14 * GIB, private=10 * GIB),
                 proc(2, "alone", 6 * GIB, avail=14 * GIB, private=6 * GIB)]
    host = assess_job(processes).hosts[0]
    assert host.needed_bytes == 16 * GIB and host.unshared_bytes == 26 * GIB
    assert host.verdict is HostFit.DOES_NOT_FIT
    assert "rank 2 6.00 GiB (a private copy)" in host.message and "rank 1 none (it maps a shared copy)" in host.message


def test_machines_are_summed_apart_and_the_smallest_reading_binds() -> None:
    processes = [proc(0, "leader", 8 * GIB, avail=20 * GIB), proc(1, "follower", avail=9 * GIB),
                 proc(2, "leader", 8 * GIB, host="n2", boot="b2", avail=7 * GIB),
                 proc(3, "follower", host="n2", boot="b2", avail=30 * GIB)]
    job = assess_job(processes)
    first, second = job.hosts
    assert (first.host, first.ranks, first.verdict) == ("n1", (0, 1), HostFit.FITS)
    assert first.binding is not None and first.binding.check.allowed_bytes == 9 * GIB  # the smaller MemAvailable
    assert (second.host, second.ranks, second.verdict) == ("n2", (2, 3), HostFit.DOES_NOT_FIT)
    assert job.refused is second and job.host_of(3) is second and job.host_of(9) is None


def test_containers_on_one_machine_each_hold_their_own_cgroup_limit() -> None:
    # Two containers (own hostnames, /dev/shm and cgroups) on one machine: MemAvailable
    # sums both; each cgroup only its own processes.
    a, b = limited(12 * GIB, 0, "pod-a"), limited(12 * GIB, 6 * GIB, "pod-b")
    processes = [proc(0, "leader", 8 * GIB, host="a", shm="sa", avail=40 * GIB, cgroup=a),
                 proc(1, "follower", host="a", shm="sa", avail=40 * GIB, cgroup=a),
                 proc(2, "leader", 8 * GIB, host="b", shm="sb", avail=40 * GIB, cgroup=b),
                 proc(3, "follower", host="b", shm="sb", avail=40 * GIB, cgroup=b)]
    (host,) = assess_job(processes).hosts
    by_scope = {(c.check.limit, c.ranks): (c.check.needed_bytes, c.check.allowed_bytes) for c in host.checks}
    assert by_scope == {(HostLimit.HOST_AVAILABLE, (0, 1, 2, 3)): (16 * GIB, 40 * GIB),
                        (HostLimit.CGROUP, (0, 1)): (8 * GIB, 12 * GIB),
                        (HostLimit.CGROUP, (2, 3)): (8 * GIB, 6 * GIB)}
    assert host.verdict is HostFit.DOES_NOT_FIT
    assert host.binding is not None and host.binding.ranks == (2, 3)
    assert host.message.startswith("ranks 2, 3 on host b need 8.00 GiB") and "the container allows 6.00 GiB more" in \
        host.message
    # Processes whose cgroups look alike are summed together (the cautious side).
    same = [attrs.evolve(p, host="a", shm_id="sa", cgroup=a) for p in processes]
    (together,) = assess_job(same).hosts
    assert [(c.check.limit, c.ranks) for c in together.checks] == [(HostLimit.HOST_AVAILABLE, (0, 1, 2, 3)),
                                                                    (HostLimit.CGROUP, (0, 1, 2, 3))]
    assert together.verdict is HostFit.DOES_NOT_FIT  # 16 GiB in a 12 GiB cgroup


def test_nothing_read_is_unknown_and_nothing_taken_fits() -> None:
    unknown = assess_job(tp_job(avail=None)).hosts[0]
    assert unknown.verdict is HostFit.UNKNOWN and not unknown.refused
    assert unknown.message.startswith("unknown: ranks 0-3 on host n1 need 20.00 GiB")
    idle = assess_job([proc(0, "alone", avail=GIB), proc(1, "alone", avail=GIB)]).hosts[0]
    assert idle.verdict is HostFit.FITS and idle.checks == () and idle.message == "fits: ranks 0, 1 on host n1 take " \
        "no new host memory"


def test_failures_are_recorded_and_ranks_must_be_unique() -> None:
    job = assess_job([proc(1, error="ExecutionError: boom"), proc(0)])
    assert job.failures == ((1, "ExecutionError: boom"),) and job.ranks == (0, 1)
    with pytest.raises(ValueError, match="every process of the job once"):
        assess_job([proc(0), proc(0)])
    with pytest.raises(ValueError, match="every process of the job once"):
        assess_job([])


@given(st.lists(st.tuples(st.sampled_from(["leader", "follower", "alone"]), st.integers(0, 1 << 40),
                          st.integers(0, 1 << 41), st.sampled_from(["b1", "b2"])), min_size=1, max_size=8))
def test_a_machine_fits_exactly_when_its_sum_is_within_its_smallest_reading(
        rows: list[tuple[str, int, int, str]]) -> None:
    processes = [proc(rank, role, new, boot=boot, avail=avail) for rank, (role, new, avail, boot) in enumerate(rows)]
    job = assess_job(processes)
    assert sorted(r for h in job.hosts for r in h.ranks) == list(range(len(rows)))  # each once
    for host in job.hosts:
        need = sum(p.new_bytes for p in host.processes)
        least = min(p.available_bytes or 0 for p in host.processes)
        assert host.needed_bytes == need
        expected = HostFit.FITS if need <= least else HostFit.DOES_NOT_FIT
        assert host.verdict is expected and host.refused is (expected is HostFit.DOES_NOT_FIT)


# ---- this process's admission and plan -----------------------------------------------------


def own_admission(pinned: tuple[LimitCheck, ...] = ()) -> HostAdmission:
    """A private copy's verdict: does not fit MemAvailable (4 KiB); `pinned` beside it."""
    host = LimitCheck(limit=HostLimit.HOST_AVAILABLE, needed_bytes=10 * GIB, allowed_bytes=4096,
                      source="the host's MemAvailable")
    return HostAdmission(verdict=HostFit.DOES_NOT_FIT, host_bytes=10 * GIB, pinned_bytes=10 * GIB,
                         checks=(host, *pinned), binding=HostLimit.HOST_AVAILABLE, message="needs a lot")


def test_a_follower_gets_the_verdict_of_its_host_not_of_a_private_copy() -> None:
    job = assess_job(tp_job(avail=25 * GIB))
    mine = local_admission(job, 2, own_admission())
    assert mine.verdict is HostFit.FITS and mine.host_bytes == 0 and mine.binding is HostLimit.HOST_AVAILABLE
    assert mine.message == ("fits: 20.00 GiB of new host memory for ranks 0-3 on host n1; the tightest limit, the "
                            "host's MemAvailable, allows 25.00 GiB")
    over = local_admission(assess_job(tp_job(avail=GIB)), 2, own_admission())
    assert over.verdict is HostFit.DOES_NOT_FIT
    assert over.message.startswith("needs 20.00 GiB of new host memory for ranks 0-3 on host n1 (rank 0 10.00 GiB")
    with pytest.raises(ValueError, match="rank 7 is not in the job"):
        local_admission(job, 7, own_admission())


def test_its_own_pinned_limits_stay_and_still_bind() -> None:
    device = LimitCheck(limit=HostLimit.DEVICE, needed_bytes=10 * GIB, allowed_bytes=GIB, source="an integrated GPU")
    memlock = LimitCheck(limit=HostLimit.MEMLOCK, needed_bytes=10 * GIB, allowed_bytes=64 << 10,
                         source="RLIMIT_MEMLOCK, ulimit -l")
    job = assess_job(tp_job(avail=25 * GIB))
    mine = local_admission(job, 0, own_admission((device, memlock)))
    # The job's (MemAvailable; the cgroup, unknown here), then its own pinned ones.
    assert [c.limit for c in mine.checks] == [HostLimit.HOST_AVAILABLE, HostLimit.CGROUP, HostLimit.DEVICE,
                                              HostLimit.MEMLOCK]
    assert mine.verdict is HostFit.DOES_NOT_FIT and mine.binding is HostLimit.DEVICE
    assert "over the locked-memory limit (advisory" in mine.message
    advisory_only = local_admission(job, 0, own_admission((memlock,)))
    assert advisory_only.verdict is HostFit.FITS and "advisory" in advisory_only.message


def _tight_plan(host_check: HostCheck = "refuse") -> OffloadPlan:
    platform = attrs.evolve(CUDA_LIKE, host_available_bytes=4096)
    config = attrs.evolve(PREFETCH, host_check=host_check)
    return make_plan(on_compute_device(describe_layers(layer_list(transformer_model(2, hidden=32)))), config,
                     EnvSnapshot(platform=platform))


def test_the_job_plan_replaces_the_admission_and_its_warning_and_nothing_else() -> None:
    plan = _tight_plan()
    assert [w.code for w in plan.warnings].count(WarningCode.HOST_MEMORY_SHORT) == 1
    fits = job_plan(plan, assess_job(tp_job(avail=25 * GIB)), 2)
    assert fits.host_admission.verdict is HostFit.FITS
    assert WarningCode.HOST_MEMORY_SHORT not in [w.code for w in fits.warnings]
    assert attrs.evolve(fits, host_admission=plan.host_admission, warnings=plan.warnings) == plan
    refused = job_plan(plan, assess_job(tp_job(avail=GIB)), 2)
    (warning,) = [w for w in refused.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
    assert "for ranks 0-3 on host n1" in warning.message and "refuses it on every rank of the job" in warning.message
    warned = job_plan(_tight_plan("warn"), assess_job(tp_job(avail=GIB, mode="warn")), 2)
    assert "host_check='warn': it runs anyway" in [w for w in warned.warnings
                                                   if w.code is WarningCode.HOST_MEMORY_SHORT][0].message
    off = job_plan(_tight_plan("off"), assess_job(tp_job(avail=GIB, mode="off")), 2)
    assert WarningCode.HOST_MEMORY_SHORT not in [w.code for w in off.warnings]


def test_the_sharing_plan_renders_the_job() -> None:
    job = assess_job(tp_job(avail=15 * GIB) + [proc(4, "alone", GIB, host="n2", boot="b2", avail=100 * GIB)])
    sharing = SharingPlan(rank=2, group_ranks=(0, 2), hosts=(HostShare(host="n1", ranks=(0, 2)),),
                          local=HostShare(host="n1", ranks=(0, 2)), shared=True, reason="ranks 0, 2 share",
                          digest="d", storages=3, host_bytes=10 * GIB, segment_bytes=10 * GIB, session="s",
                          timeout_s=5.0, job=job)
    lines = render_sharing(sharing).splitlines()
    job_lines = lines[lines.index(next(line for line in lines if line.startswith("job:"))):]
    assert job_lines[0] == ("job:      5 processes (ranks 0-4) on 2 hosts, host memory summed per host: does not fit "
                            "on host n1: wrap_modules refuses it on every rank")
    assert job_lines[1].startswith("  ranks 0-3 on host n1 need 20.00 GiB of new host memory")
    assert job_lines[2] == ("  fits: rank 4 on host n2 needs 1.00 GiB of new host memory (rank 4 1.00 GiB (a private "
                            "copy)); the tightest limit, the host's MemAvailable, allows 100.00 GiB (0 B with private "
                            "copies)")
    assert "job:" not in render_sharing(attrs.evolve(sharing, job=None))
