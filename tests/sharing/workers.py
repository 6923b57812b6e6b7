"""What each rank process of the multi-process tests runs (`tests.sharing.cluster` starts
them): torch.distributed over gloo with a FileStore, one scenario, its result as JSON in
the output folder, then ``os._exit`` (no interpreter shutdown that could wait on a dead
peer).

Scenarios (``run(rank, world, out_dir, **kwargs) -> dict``):

- ``parity``: `tests.sharing.scenarios.parity` (and its memory, measured) per kind.
- ``engine``: `tests.sharing.scenarios.engine`.
- ``leader_killed``: the leader dies inside wrap_modules, after every follower mapped
  the segment and before it is written; followers must raise within the timeout.
- ``follower_killed``: after everyone ran, rank 1 dies; the others must keep working.
- ``mismatch``: rank 1 offloads a weight of another dtype (refused on both at
  create_offloader), then holds other values of the same shapes (refused on both at
  wrap_modules, each model left as it was).
- ``absent``: rank 2 never calls create_offloader (it stays alive until the others are
  done, so that nothing but a timeout can end their wait); the others must raise within
  the sharing timeout, naming it, long before gloo's.
- ``job_admission``, ``job_failure``: the job's host admission, `tests.sharing.job_workers`.
- ``cuda``: on a CUDA machine (the GPU tier, `tests/gpu/test_sharing_gpu.py`): a plan
  for this machine (pinning as it decides), weights from the host, forwards on the
  device against a resident copy there; whether every host copy is page-locked and in
  the segment, the live check, the segment's memory, restore.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import FileStore

from offload import OffloadPlan, create_offloader
from offload.protocols import Offloader
from offload.sharing import ShareWith
from tests.executors.helpers import assert_restored, cpu_plan, snapshot
from tests.executors.models import layer_list
from tests.sharing.job_workers import JOB_SCENARIOS
from tests.sharing.scenarios import CONFIGS, build, engine, expect_failure, inputs_of, parity, reload, shared, untouched

__all__ = ["GLOO_TIMEOUT_S", "PATIENT_S", "SCENARIOS", "TIMEOUT_S", "rank_main"]

#: Seconds a member waits for another where a test waits for a timeout to run out.
TIMEOUT_S = 2.0
#: Seconds gloo's collectives wait (the process group's timeout).
GLOO_TIMEOUT_S = 30.0
#: Seconds a member waits for another elsewhere: generous, so that a loaded machine
#: cannot fail a test whose members all answer.
PATIENT_S = 20.0


def _make(timeout_s: float = PATIENT_S) -> Callable[[OffloadPlan], Offloader]:
    def make(plan: OffloadPlan) -> Offloader:
        return create_offloader(plan, share_with=ShareWith(timeout_s=timeout_s))

    return make


def _sync() -> None:
    dist.barrier()


def _parity(rank: int, world: int, out_dir: Path, *, kinds: list[str]) -> dict[str, Any]:
    return {kind: parity(rank, _make(), _sync, kind=kind, measure=True) for kind in kinds}


def _engine(rank: int, world: int, out_dir: Path, *, kind: str) -> dict[str, Any]:
    return engine(rank, _make(), _sync, kind=kind, measure=True)


def _reload(rank: int, world: int, out_dir: Path, *, kinds: list[str]) -> dict[str, Any]:
    return {kind: reload(rank, _make(), _sync, kind=kind) for kind in kinds}


def _leader_killed(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    model = build(2, hidden=32)
    before = snapshot(model)
    off = create_offloader(cpu_plan(model, CONFIGS["prefetch"]), share_with=ShareWith(timeout_s=TIMEOUT_S))
    layers = layer_list(model)
    if rank == 0:
        # The executor's first look at the layers (after the followers mapped the segment
        # and its name was unlinked, before anything is written): this process dies there.
        def die(target: str) -> nn.Parameter:
            os._exit(17)

        layers[0].get_parameter = die  # type: ignore[method-assign]  # an instance attribute on purpose
        off.wrap_modules(layers)
        return {"survived": True}
    message, seconds = expect_failure(lambda: off.wrap_modules(layers))
    return {"error": message, "seconds": seconds, "untouched": untouched(model, before)}


def _gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie whose memory is already given back)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read
        return True


def _follower_killed(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    model = build(4)
    resident = build(4)
    before = snapshot(model)
    off = shared(create_offloader(cpu_plan(model, CONFIGS["prefetch"]), share_with=ShareWith(timeout_s=PATIENT_S)))
    off.wrap_modules(layer_list(model))
    off.post_init()
    xs = list(inputs_of(5, 128))
    first = [bool(torch.equal(model(x), resident(x))) for x in xs]
    (out_dir / f"pid-{rank}").write_text(str(os.getpid()))
    dist.barrier()  # the last collective: rank 1 dies after it
    if rank == 1:
        os._exit(0)
    pid = int((out_dir / "pid-1").read_text())
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    after = [bool(torch.equal(model(x), resident(x))) for x in xs]
    off.restore()
    try:
        assert_restored(model, before, same_storage=False)  # private storage again: bits, not addresses
        restored = True
    except AssertionError:
        restored = False
    return {"first": first, "after": after, "dead": _gone(pid), "restored": restored}


def _mismatch(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    model = build(2, hidden=32)
    if rank == 1:
        weight = model.get_parameter("1.mlp.down.weight")
        weight.data = weight.data.to(torch.bfloat16)
    plan = cpu_plan(model, CONFIGS["prefetch"])
    refused, _ = expect_failure(lambda: create_offloader(plan, share_with=ShareWith(timeout_s=PATIENT_S)))
    other: nn.Sequential = build(2, hidden=32, seed=rank)  # same shapes, other values
    before = snapshot(other)
    off = create_offloader(cpu_plan(other, CONFIGS["uva"]), share_with=ShareWith(timeout_s=PATIENT_S))
    differs, _ = expect_failure(lambda: off.wrap_modules(layer_list(other)))  # on both: the leader too
    try:
        assert_restored(other, before, same_storage=rank == 1)  # the follower moved nothing at all
        restored = True
    except AssertionError:
        restored = False
    return {"refused": refused, "differs": differs, "restored": restored}


def _absent(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    if rank == 2:
        deadline = time.monotonic() + GLOO_TIMEOUT_S + 10
        while not all((out_dir / f"done-{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"absent": True}
    plan = cpu_plan(build(2, hidden=32), CONFIGS["prefetch"])
    start = time.monotonic()
    try:
        create_offloader(plan, share_with=ShareWith(timeout_s=TIMEOUT_S))
        outcome: dict[str, Any] = {"type": None}
    except Exception as exc:  # any kind: the test asserts which
        value = getattr(exc, "value", None)
        outcome = {"type": type(exc).__name__, "error": str(exc),
                   "value": list(value) if isinstance(value, tuple) else value}
    outcome["seconds"] = time.monotonic() - start
    (out_dir / f"done-{rank}").write_text("")
    return outcome


def _cuda(rank: int, world: int, out_dir: Path, *, kind: str) -> dict[str, Any]:
    import copy

    from offload import capture_env, describe_layers, make_plan
    from offload.capture.smaps import segment_memory

    torch.cuda.set_device(0)
    model = build(4, hidden=256)  # in host memory: offloaded weights are copied into the segment
    resident = copy.deepcopy(model).cuda()
    config = CONFIGS["prefetch"] if kind == "prefetch" else CONFIGS["uva"]
    plan = make_plan(describe_layers(layer_list(model)), config, capture_env(os.environ))
    off = shared(create_offloader(plan, share_with=ShareWith(timeout_s=60)))
    off.wrap_modules(layer_list(model))
    off.post_init()
    xs = [x.cuda() for x in inputs_of(1, 256)]
    equal = [bool(torch.equal(model(x), resident(x))) for x in xs]
    torch.cuda.synchronize()
    state = model.state_dict()
    offloaded = [state[f"{p.layer}.{p.name}"] for p in off.plan.offloaded_params]
    segment = off.segment
    inside = sum(1 for t in offloaded if segment is not None and segment.contains(t))
    pinned = sum(1 for t in offloaded if t.is_pinned())
    differences = [f"{d.layer}.{d.name}: {d.actual.value}" for d in off.check().differences]
    fallbacks = off.stats().pin_fallbacks
    dist.barrier()
    memory = segment_memory(segment.name) if segment is not None else None
    dist.barrier()
    before = {n: p.detach().cpu().clone() for n, p in resident.named_parameters()}
    off.restore()
    restored = all(torch.equal(p.detach().cpu(), before[n]) for n, p in model.named_parameters())
    return {"role": off.sharing.role, "pin": plan.pin.method.value, "equal": equal, "offloaded": len(offloaded),
            "in_segment": inside, "pinned": pinned, "fallbacks": fallbacks, "differences": differences,
            "pss": memory.pss_bytes if memory is not None else 0, "host_bytes": plan.host_bytes,
            "restored": restored}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "cuda": _cuda,
    "parity": _parity,
    "engine": _engine,
    "reload": _reload,
    "leader_killed": _leader_killed,
    "follower_killed": _follower_killed,
    "mismatch": _mismatch,
    "absent": _absent,
    **JOB_SCENARIOS,  # the job's host admission (tests.sharing.job_workers)
}


def rank_main(rank: int, world: int, store_path: str, out_dir: str, scenario: str, kwargs: dict[str, Any]) -> None:
    """One rank: join the group, run `scenario`, write ``result-<rank>.json``, exit."""
    out = Path(out_dir)
    result: dict[str, Any]
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        with torch.no_grad():
            result = {"ok": True, "result": SCENARIOS[scenario](rank, world, out, **kwargs)}
    except BaseException as exc:  # reported to the test, which asserts on it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    os._exit(0)
