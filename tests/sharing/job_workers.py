"""Scenarios of the job's host admission for the rank processes (`tests.sharing.workers`
runs them; `tests/sharing/test_job_processes.py` asserts on them): tensor parallelism 2
x data parallelism 2 in 4 processes, each pair of one shard a sharing group
(``dist.new_group``), the job the default group, gathered with ``all_gather_object``
over gloo; host memory readings injected, so that the sum is what decides.

- ``job_admission``: learn what the host needs (an offloader with room to spare), then
  one byte less (refused on every rank, models untouched), then exactly that (every rank
  runs bit for bit).
- ``job_failure``: rank 3's weights differ from rank 1's; every rank raises at
  ``create_offloader``, none waits.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from offload import Platform
from offload.runtime.cpu import CpuRuntime
from offload.sharing import SharedOffloader, ShareWith, share_offloader
from tests.executors.helpers import cpu_plan, snapshot
from tests.executors.models import layer_list
from tests.sharing.scenarios import CONFIGS, build, expect_failure, inputs_of, shared, untouched

__all__ = ["JOB_SCENARIOS"]

#: Seconds a member waits for another: generous (every failure here comes at once).
PATIENT_S = 20.0


def _shard_group(rank: int) -> dist.ProcessGroup:
    """Ranks 0 and 2 hold one shard, 1 and 3 the other (every rank makes both groups)."""
    groups: list[dist.ProcessGroup] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return groups[rank % 2]


def _job_admission(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    group = _shard_group(rank)
    model = build(2, hidden=32, seed=rank % 2)
    resident = copy.deepcopy(model)
    before = snapshot(model)
    plan = cpu_plan(model, CONFIGS["prefetch"])

    def make(available: int) -> SharedOffloader:
        return shared(share_offloader(plan, CpuRuntime(), ShareWith(group=group, timeout_s=PATIENT_S),
                                      host_memory=Platform(host_available_bytes=available)))

    job = make(1 << 50).sharing.job
    assert job is not None
    host = job.host_of(rank)
    assert host is not None
    needed = host.needed_bytes
    short = make(needed - 1)
    message, seconds = expect_failure(lambda: short.wrap_modules(layer_list(model)))
    same = untouched(model, before)
    roomy = make(needed)
    roomy.wrap_modules(layer_list(model))
    roomy.post_init()
    equal = [bool(torch.equal(model(x), resident(x))) for x in inputs_of(7, 32)]
    roomy.restore()
    return {"needed": needed, "ranks": list(host.ranks), "role": roomy.sharing.role,
            "segment": roomy.layout.total_bytes, "buffers": plan.device_bytes_buffers, "refused": message,
            "seconds": seconds, "untouched": same, "equal": equal}


def _job_failure(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    group = _shard_group(rank)
    model = build(2, hidden=32, seed=rank % 2)
    if rank == 3:
        weight = model.get_parameter("0.mlp.down.weight")
        weight.data = weight.data.to(torch.bfloat16)
    plan = cpu_plan(model, CONFIGS["prefetch"])
    start = time.monotonic()
    message, _ = expect_failure(lambda: share_offloader(plan, CpuRuntime(), ShareWith(group=group, timeout_s=PATIENT_S),
                                                        host_memory=Platform(host_available_bytes=1 << 50)))
    return {"error": message, "seconds": time.monotonic() - start}


JOB_SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "job_admission": _job_admission,
    "job_failure": _job_failure,
}
