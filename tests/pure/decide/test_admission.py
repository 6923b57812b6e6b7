"""Host admission: the verdict `make_plan` records about the host
memory a plan takes, the warnings that agree with it, and its JSON."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from offload.errors import ConfigError
from offload.pure import (
    CgroupMemory,
    EnvFlags,
    EnvSnapshot,
    HostCheck,
    HostFit,
    HostLimit,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    Platform,
    WarningCode,
    decide_host_admission,
    make_plan,
    render_plan,
)
from offload.pure.decide.admission import ADVISORY_LIMITS, NOT_CHECKED, HostAdmission, host_room
from offload.pure.serialize import from_data, to_data
from tests.pure.strategies import env_snapshots, model_specs, offload_configs

GiB = 1 << 30


def spec(num_layers: int = 8, *, device: str = "compute", devices: tuple[str, ...] | None = None) -> ModelSpec:
    """`num_layers` layers of one 1 GiB float32 weight each (shapes only)."""
    where = devices or (device,) * num_layers
    return ModelSpec(layers=tuple(
        LayerSpec(index=i, name=f"model.layers.{i}", params=(
            ParamSpec(name="mlp.w", shape=(GiB // 4,), stride=(1,), dtype="float32", itemsize=4, device=where[i]),
        ))
        for i in range(num_layers)
    ))


#: Every 2nd layer offloaded: 4 GiB of host copies, 1 GiB of buffers, 4 GiB resident.
HALF = OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1)
UVA = OffloadConfig(uva_max_bytes=4 * GiB)

#: A discrete GPU with room everywhere: pinned copies, registered in place.
ROOMY = Platform(
    has_cuda=True, device_name="Test GPU", device_total_bytes=80 * GiB, can_map_host_memory=True,
    can_register_host_memory=True, host_pointer_for_registered_memory=True,
    host_total_bytes=512 * GiB, host_available_bytes=400 * GiB,
)


def cgroup(limit: int | None, current: int | None = 0, reclaimable: int | None = None) -> CgroupMemory:
    return CgroupMemory(version=2, limit_bytes=limit, current_bytes=current, reclaimable_bytes=reclaimable,
                        limit_path="/sys/fs/cgroup/ctr/memory.max", cgroup_path="/ctr")


def env(flags: EnvFlags | None = None, **platform: Any) -> EnvSnapshot:
    return EnvSnapshot(flags=flags or EnvFlags(), platform=attrs.evolve(ROOMY, **platform))


GH200: dict[str, Any] = {"device_name": "NVIDIA GH200 480GB", "pageable_memory_access": True, "pageable_uses_host_page_tables": True}

# name, config, spec, env -> verdict, binding, new host bytes, pinned bytes, words in the message
CASES: list[tuple[str, OffloadConfig, ModelSpec, EnvSnapshot, HostFit, HostLimit | None, int, int, tuple[str, ...]]] = [
    ("fits, cgroup tightest", HALF, spec(), env(cgroup_memory=cgroup(64 * GiB, 10 * GiB)),
     HostFit.FITS, HostLimit.CGROUP, 4 * GiB, 4 * GiB, ("fits", "54.00 GiB")),
    ("cgroup binds", HALF, spec(), env(cgroup_memory=cgroup(6 * GiB, 3 * GiB)),
     HostFit.DOES_NOT_FIT, HostLimit.CGROUP, 4 * GiB, 4 * GiB,
     ("needs 4.00 GiB of new host memory, all of it pinned", "the container allows 3.00 GiB more",
      "cgroup v2 memory.max at /sys/fs/cgroup/ctr", "limit 6.00 GiB", "3.00 GiB in use")),
    ("cgroup cache is room", HALF, spec(), env(cgroup_memory=cgroup(6 * GiB, 3 * GiB, 2 * GiB)),
     HostFit.FITS, HostLimit.CGROUP, 4 * GiB, 4 * GiB, ("5.00 GiB",)),
    ("cgroup usage unread, need above the limit", HALF, spec(), env(cgroup_memory=cgroup(3 * GiB, None)),
     HostFit.DOES_NOT_FIT, HostLimit.CGROUP, 4 * GiB, 4 * GiB, ("usage unknown",)),
    ("MemAvailable binds", HALF, spec(), env(host_available_bytes=2 * GiB, cgroup_memory=cgroup(None)),
     HostFit.DOES_NOT_FIT, HostLimit.HOST_AVAILABLE, 4 * GiB, 4 * GiB,
     ("only 2.00 GiB is available", "MemAvailable")),
    ("the smaller of MemAvailable and headroom binds", HALF, spec(),
     env(host_available_bytes=3 * GiB, cgroup_memory=cgroup(5 * GiB, 3 * GiB)),
     HostFit.DOES_NOT_FIT, HostLimit.CGROUP, 4 * GiB, 4 * GiB, ("also over MemAvailable",)),
    # The locked-memory limit is advisory: CUDA's page-locking is not refused for it here,
    # and a pin that fails falls back to pageable memory (counted); nothing is killed.
    ("memlock: advisory, the verdict stays", HALF, spec(), env(memlock_limit_bytes=64 << 20),
     HostFit.FITS, HostLimit.HOST_AVAILABLE, 4 * GiB, 4 * GiB,
     ("over the locked-memory limit (advisory", "needs 4.00 GiB of pinned host memory", "allows 64.0 MiB",
      "RLIMIT_MEMLOCK")),
    ("memlock does not apply to pageable memory", HALF, spec(),
     env(EnvFlags(disable_pin_memory=True), memlock_limit_bytes=64 << 20),
     HostFit.FITS, HostLimit.HOST_AVAILABLE, 4 * GiB, 0, ("fits",)),
    ("pageable over MemAvailable", HALF, spec(), env(EnvFlags(disable_pin_memory=True), host_available_bytes=GiB),
     HostFit.DOES_NOT_FIT, HostLimit.HOST_AVAILABLE, 4 * GiB, 0, ("needs 4.00 GiB of new host memory;",)),
    ("GH200: pinned memory counts against the device", HALF, spec(), env(device_total_bytes=6 * GiB, **GH200),
     HostFit.DOES_NOT_FIT, HostLimit.DEVICE, 4 * GiB, 4 * GiB,
     ("needs 4.00 GiB of pinned host memory", "only 1.00 GiB of device memory is left", "NVIDIA GH200",
      "keeps 5.00 GiB for resident weights and buffers")),
    ("GH200 pageable: nothing against the device", HALF, spec(),
     env(EnvFlags(disable_pin_memory=True), device_total_bytes=6 * GiB, **GH200),
     HostFit.FITS, HostLimit.HOST_AVAILABLE, 4 * GiB, 0, ()),
    ("GH200 with room", HALF, spec(), env(device_total_bytes=96 * GiB, **GH200),
     HostFit.FITS, HostLimit.DEVICE, 4 * GiB, 4 * GiB, ("hardware-coherent unified memory",)),
    ("integrated GPU", UVA, spec(), env(device_total_bytes=7 * GiB, is_integrated=True),
     HostFit.DOES_NOT_FIT, HostLimit.DEVICE, 4 * GiB, 4 * GiB, ("an integrated GPU",)),
    ("unknown: neither MemAvailable nor the cgroup", HALF, spec(), env(host_available_bytes=None),
     HostFit.UNKNOWN, None, 4 * GiB, 4 * GiB, ("unknown", "neither MemAvailable nor the cgroup")),
    ("MemAvailable known, cgroup unknown", HALF, spec(), env(),
     HostFit.FITS, HostLimit.HOST_AVAILABLE, 4 * GiB, 4 * GiB, ("not checked, unknown: the cgroup limit",)),
    ("weights already in host memory: pinned, no new memory", HALF, spec(device="cpu"),
     env(cgroup_memory=cgroup(GiB, GiB // 2)),
     HostFit.FITS, None, 0, 4 * GiB, ("no new host memory", "no limit applies to the 4.00 GiB it pins")),
    ("already in host memory, over memlock", HALF, spec(device="cpu"), env(memlock_limit_bytes=GiB),
     HostFit.FITS, None, 0, 4 * GiB, ("no new host memory", "over the locked-memory limit (advisory")),
    ("mixed devices count only the new copies", HALF,
     # offloaded: layer 1 (host), 3 (device: copied), 5 (meta: new), 7 (host)
     spec(devices=("cpu", "cpu", "cuda:0", "cuda:0", "meta", "meta", "compute", "cpu")), env(),
     HostFit.FITS, HostLimit.HOST_AVAILABLE, 2 * GiB, 4 * GiB, ("2.00 GiB of new host memory",)),
    ("no accelerator: weights stay, buffers are host memory", HALF, spec(),
     EnvSnapshot(platform=Platform(host_available_bytes=512 << 20)),
     HostFit.DOES_NOT_FIT, HostLimit.HOST_AVAILABLE, GiB, 0, ("needs 1.00 GiB of new host memory",)),
    ("nothing offloaded", OffloadConfig(backend="none"), spec(), env(host_available_bytes=0),
     HostFit.FITS, None, 0, 0, ("takes no new host memory and pins none",)),
]


@pytest.mark.parametrize(("config", "model", "snapshot", "verdict", "binding", "host", "pinned", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_verdicts(config: OffloadConfig, model: ModelSpec, snapshot: EnvSnapshot, verdict: HostFit,
                  binding: HostLimit | None, host: int, pinned: int, words: tuple[str, ...]) -> None:
    plan = make_plan(model, config, snapshot)
    admission = plan.host_admission
    assert (admission.verdict, admission.binding) == (verdict, binding), admission.message
    assert (admission.host_bytes, admission.pinned_bytes) == (host, pinned)
    for word in words:
        assert word in admission.message, admission.message
    assert admission == decide_host_admission(plan, snapshot)
    if binding is not None:
        check = admission.binding_check
        assert check is not None and check.limit is binding
        assert (check.fits is False) == (verdict is HostFit.DOES_NOT_FIT)
    assert any(c.limit not in ADVISORY_LIMITS for c in admission.failed) == (verdict is HostFit.DOES_NOT_FIT)


def test_the_binding_limit_is_the_most_exceeded() -> None:
    plan = make_plan(spec(), HALF, env(host_available_bytes=3 * GiB, memlock_limit_bytes=GiB,
                                       cgroup_memory=cgroup(5 * GiB, 4 * GiB)))
    admission = plan.host_admission
    margins = {c.limit: c.margin_bytes for c in admission.failed}
    assert margins == {HostLimit.HOST_AVAILABLE: -GiB, HostLimit.CGROUP: -3 * GiB, HostLimit.MEMLOCK: -3 * GiB}
    assert admission.binding is HostLimit.CGROUP  # the first of the two most exceeded, in check order
    assert "also over MemAvailable; over the locked-memory limit (advisory" in admission.message


def test_unlimited_cgroup_is_not_a_check_and_unknown_is() -> None:
    unlimited = make_plan(spec(), HALF, env(cgroup_memory=cgroup(None))).host_admission
    unknown = make_plan(spec(), HALF, env()).host_admission
    assert HostLimit.CGROUP not in {c.limit for c in unlimited.checks}
    (check,) = [c for c in unknown.checks if c.limit is HostLimit.CGROUP]
    assert (check.allowed_bytes, check.fits) == (None, None)


@settings(max_examples=80, deadline=None)
@given(model_specs(), offload_configs(), env_snapshots())
def test_the_recorded_verdict_is_the_one_decided_from_the_plan(
    model: ModelSpec, config: OffloadConfig, snapshot: EnvSnapshot
) -> None:
    plan = make_plan(model, config, snapshot)
    admission = plan.host_admission
    assert admission == decide_host_admission(plan, snapshot)
    assert admission.pinned_bytes == (plan.host_bytes if plan.pin.pin else 0)
    extra = plan.device_bytes_buffers if plan.compute_device == "cpu" else 0
    assert admission.host_bytes <= plan.host_bytes + extra
    if admission.verdict is HostFit.DOES_NOT_FIT:
        assert admission.binding is not None and admission.failed
    room, _ = host_room(snapshot.platform)
    if room is not None and admission.host_bytes > room:
        assert admission.verdict is HostFit.DOES_NOT_FIT


def test_host_room_is_the_smaller_of_memavailable_and_headroom() -> None:
    assert host_room(attrs.evolve(ROOMY, cgroup_memory=cgroup(10 * GiB, 4 * GiB))) == (
        6 * GiB, "cgroup v2 memory.max at /sys/fs/cgroup/ctr: limit 10.00 GiB, 4.00 GiB in use")
    assert host_room(attrs.evolve(ROOMY, host_available_bytes=GiB, cgroup_memory=cgroup(10 * GiB))) == (
        GiB, "the host's MemAvailable")
    assert host_room(Platform())[0] is None


# ---------------------------------------------------------------- warnings agree with it


def _codes(plan: OffloadPlan) -> list[WarningCode]:
    return [w.code for w in plan.warnings]


def test_memavailable_and_cgroup_over_give_one_host_memory_warning() -> None:
    plan = make_plan(spec(), HALF, env(host_available_bytes=3 * GiB, cgroup_memory=cgroup(5 * GiB, 3 * GiB)))
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
    assert "the container allows 2.00 GiB more" in warning.message  # the binding one of the two
    assert "wrap_modules refuses this plan" in warning.message


def test_a_plan_that_fits_has_no_host_memory_warning() -> None:
    plan = make_plan(spec(), HALF, env(cgroup_memory=cgroup(64 * GiB)))
    assert plan.host_admission.verdict is HostFit.FITS
    assert not {WarningCode.HOST_MEMORY_SHORT, WarningCode.MEMLOCK_LIMIT,
                WarningCode.DEVICE_MEMORY_SHORT} & set(_codes(plan))


def test_pinned_memory_in_host_memory_already_is_not_short_of_host_memory() -> None:
    # The old warning compared every offloaded byte with MemAvailable, even weights that
    # are host memory already; the verdict counts only new memory, and so do the warnings.
    plan = make_plan(spec(device="cpu"), HALF, env(host_available_bytes=GiB))
    assert plan.host_admission.verdict is HostFit.FITS
    assert WarningCode.HOST_MEMORY_SHORT not in _codes(plan)


def test_device_shortage_replaces_the_general_unified_memory_warning() -> None:
    short = make_plan(spec(), HALF, env(device_total_bytes=6 * GiB, **GH200))
    assert WarningCode.DEVICE_MEMORY_SHORT in _codes(short)
    assert WarningCode.COHERENT_UNIFIED_MEMORY not in _codes(short)
    (warning,) = [w for w in short.warnings if w.code is WarningCode.DEVICE_MEMORY_SHORT]
    assert "OFFLOAD_DISABLE_PIN_MEMORY=1" in warning.message
    roomy = make_plan(spec(), HALF, env(device_total_bytes=96 * GiB, **GH200))
    assert WarningCode.COHERENT_UNIFIED_MEMORY in _codes(roomy)
    assert WarningCode.DEVICE_MEMORY_SHORT not in _codes(roomy)


@pytest.mark.parametrize(("mode", "words"), [
    ("refuse", "wrap_modules refuses this plan before moving anything"),
    ("warn", "host_check='warn': it runs anyway"),
])
def test_warnings_say_what_host_check_will_do(mode: HostCheck, words: str) -> None:
    plan = make_plan(spec(), attrs.evolve(HALF, host_check=mode), env(host_available_bytes=GiB))
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.HOST_MEMORY_SHORT]
    assert words in warning.message


@pytest.mark.parametrize("mode", ["refuse", "warn"])
def test_the_memlock_warning_says_pinning_may_fall_back_and_nothing_is_refused(mode: HostCheck) -> None:
    plan = make_plan(spec(), attrs.evolve(HALF, host_check=mode), env(memlock_limit_bytes=GiB))
    assert plan.host_admission.verdict is HostFit.FITS
    (warning,) = [w for w in plan.warnings if w.code is WarningCode.MEMLOCK_LIMIT]
    assert "ulimit -l" in warning.message and "fall back to pageable memory" in warning.message
    assert "refuses" not in warning.message


def test_host_check_off_records_the_verdict_without_warnings() -> None:
    plan = make_plan(spec(), attrs.evolve(HALF, host_check="off"), env(memlock_limit_bytes=GiB,
                                                                     host_available_bytes=GiB))
    assert plan.host_admission.verdict is HostFit.DOES_NOT_FIT
    assert not {WarningCode.HOST_MEMORY_SHORT, WarningCode.MEMLOCK_LIMIT} & set(_codes(plan))
    assert "not enforced (host_check='off')" in render_plan(plan)


def test_render_shows_the_verdict_and_each_limit() -> None:
    plan = make_plan(spec(), HALF, env(cgroup_memory=cgroup(6 * GiB, 3 * GiB)))
    text = render_plan(plan)
    (head,) = [line for line in text.splitlines() if line.startswith("host mem:")]
    assert head.startswith("host mem: does not fit, wrap_modules refuses it (host_check='refuse'): needs 4.00 GiB")
    assert ("  over cgroup v2 memory.max at /sys/fs/cgroup/ctr: limit 6.00 GiB, 3.00 GiB in use: 4.00 GiB new host "
            "memory needed, 3.00 GiB allowed (binds)") in text
    assert "  ok   the host's MemAvailable: 4.00 GiB new host memory needed, 400.00 GiB allowed" in text
    fits = render_plan(make_plan(spec(), HALF, env(cgroup_memory=cgroup(64 * GiB))))
    assert "host mem: fits:" in fits and "(tightest)" in fits


# ---------------------------------------------------------------- config and JSON


def test_host_check_defaults_to_refuse_and_refuses_junk_by_name() -> None:
    assert OffloadConfig().host_check == "refuse"
    goods: tuple[HostCheck, ...] = ("refuse", "warn", "off")
    for good in goods:
        assert OffloadConfig(host_check=good).host_check == good
    with pytest.raises(ConfigError) as caught:
        OffloadConfig(host_check="ignore")  # type: ignore[arg-type]  # junk on purpose
    assert (caught.value.name, caught.value.value) == ("host_check", "ignore")
    assert "refuse, warn, off" in str(caught.value)


def test_plan_json_round_trips_the_verdict_and_host_check() -> None:
    plan = make_plan(spec(), attrs.evolve(HALF, host_check="warn"), env(cgroup_memory=cgroup(6 * GiB, 3 * GiB)))
    text = plan.to_json()
    document = json.loads(text)
    assert document["plan"]["config"]["host_check"] == "warn"
    assert document["plan"]["host_admission"]["verdict"] == "does_not_fit"
    assert document["plan"]["host_admission"]["binding"] == "cgroup"
    back = OffloadPlan.from_json(text)
    assert back == plan
    assert back.host_admission.checks == plan.host_admission.checks


def test_old_plan_json_without_the_verdict_or_host_check_still_loads() -> None:
    plan = make_plan(spec(), HALF, env(cgroup_memory=cgroup(6 * GiB, 3 * GiB)))
    document = json.loads(plan.to_json())
    del document["plan"]["host_admission"]
    del document["plan"]["config"]["host_check"]
    old = OffloadPlan.from_json(json.dumps(document))
    assert old.host_admission == NOT_CHECKED
    assert old.host_admission.verdict is HostFit.UNKNOWN  # never refused: nothing was checked
    assert old.config.host_check == "refuse"
    assert attrs.evolve(old, host_admission=plan.host_admission) == plan


def test_snapshot_json_round_trips_the_cgroup_and_old_json_reads_as_unknown() -> None:
    snapshot = env(cgroup_memory=cgroup(6 * GiB, 3 * GiB, GiB))
    data = to_data(snapshot)
    assert data["platform"]["cgroup_memory"]["limit_bytes"] == 6 * GiB
    assert from_data(EnvSnapshot, data) == snapshot
    del data["platform"]["cgroup_memory"]
    assert from_data(EnvSnapshot, data).platform.cgroup_memory == CgroupMemory()


def test_a_tampered_verdict_is_a_plan_error() -> None:
    plan = make_plan(spec(), HALF, env(cgroup_memory=cgroup(6 * GiB, 3 * GiB)))
    document = json.loads(plan.to_json())
    document["plan"]["host_admission"]["binding"] = "memlock"  # not one of its checks
    with pytest.raises(ValueError, match="binding"):
        OffloadPlan.from_json(json.dumps(document))
    document["plan"]["host_admission"]["verdict"] = "maybe"
    with pytest.raises(ValueError, match="verdict"):
        OffloadPlan.from_json(json.dumps(document))


def test_not_checked_is_the_default() -> None:
    assert HostAdmission() == NOT_CHECKED
    assert (NOT_CHECKED.verdict, NOT_CHECKED.checks, NOT_CHECKED.binding) == (HostFit.UNKNOWN, (), None)
