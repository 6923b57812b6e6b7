"""Peak host memory (``VmHWM``) and page cache while a model three times larger than its
host budget is loaded and run with the disk tier (`offload_pretrained(...,
host_budget_bytes=)`), in fresh interpreters (`tests/hf/load_script.py`), measured
against the same script run resident on a smaller model of the same width.

The big checkpoint is a random Llama-shaped float32 model of 342 MB (24 layers of 12.8 MB,
width 512; embeddings and head of 16.8 MB each), in 5 shards; the small one has 6 of those
layers (111 MB). The disk process offloads every layer of the big one (prefetch depth 2)
with a host budget of 100 MiB: 6 layers stay in host memory, 18 go to disk, and a ring of
two staging buffers holds what is being read. So it holds about what the small resident
process holds (6 layers, the embeddings and head) plus the ring, the static buffers (host
memory on the CPU runtime) and the disk reader's per-thread staging; if it held the disk
tier too, its peak would be 220 MiB higher.

Measured on the 2-core development machine (MiB, 3 runs each): baseline 354-355; disk 539-540
at the forward, 520-524 at ready; small resident 472-473. Bound: 472 + 24.5 (ring) + 24.5
(buffers) + 64 (reader staging, at most) + 16 = 601. The checkpoint's pages in the page
cache after the forward: none of 326 MiB (8.5 MiB before the loader read with ``O_DIRECT``
and the headers were read without readahead; `tests/hf/test_page_cache.py` checks each file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from offload.runtime.diskio import CHUNK_BYTES, THREADS
from offload.runtime.diskrate import evict
from tests.hf.load_script import STATUS, build

SCRIPT = Path(__file__).with_name("load_script.py")
ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BUDGET_MIB = 100

#: Allocator and page rounding, the plan, hooks and executor objects, the forward's
#: activations.
ALLOWANCE = 16 * MIB

#: The most the disk reader's threads stage (each allocates one chunk on first use).
READER_STAGING = THREADS * CHUNK_BYTES

Report = dict[str, Any]


def _launch(args: list[str]) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "VLLM_"))}
    environ["HF_HUB_OFFLINE"] = "1"
    return subprocess.Popen([sys.executable, "-W", "error", str(SCRIPT), *args], cwd=ROOT, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Report]:
    assert STATUS.is_file(), f"{STATUS} is missing: this test reads peak host memory (VmHWM) from it"
    root = tmp_path_factory.mktemp("disk-memory")
    big, small, spill = root / "big", root / "small", root / "spill"
    spill.mkdir()
    nbytes = build(big, hidden=512, layers=24)
    build(small, hidden=512, layers=6)
    evict(sorted(big.glob("*.safetensors")))
    evict(sorted(small.glob("*.safetensors")))
    running = {
        "baseline": _launch(["baseline", str(big)]),
        "disk": _launch(["disk", str(big), "--host-budget-mib", str(BUDGET_MIB), "--spill-dir", str(spill)]),
        "resident": _launch(["resident", str(small)]),
    }
    found: dict[str, Report] = {}
    for mode, process in running.items():
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, f"load_script {mode} exited {process.returncode}:\n{err}"
        found[mode] = {**json.loads(out), "checkpoint_bytes": nbytes}
    assert list(spill.iterdir()) == []  # nothing spilled, nothing left
    return found


def _peak(report: Report, stage: str = "forward") -> int:
    value: int = report["stages"][stage]["VmHWM"]
    return value


def test_the_model_is_three_times_the_budget_and_the_disk_tier_was_read(reports: dict[str, Report]) -> None:
    disk = reports["disk"]
    assert disk["model_bytes"] == disk["checkpoint_bytes"] >= 3 * BUDGET_MIB * MIB
    tier = disk["disk"]
    assert tier["layers"] > 0 and tier["host_tier_bytes"] > 0 and tier["spill_bytes"] == 0
    assert tier["host_tier_bytes"] + tier["ring_bytes"] <= BUDGET_MIB * MIB
    assert tier["read_bytes"] >= tier["disk_bytes"]  # the forward read every disk layer


def test_peak_is_the_small_resident_peak_plus_the_ring_buffers_and_reader(reports: dict[str, Report]) -> None:
    disk, resident = reports["disk"], reports["resident"]
    # The small resident model holds what the disk process keeps in host memory.
    held = disk["disk"]["host_tier_bytes"] + (disk["model_bytes"] - disk["plan"]["host_bytes"])
    assert abs(resident["model_bytes"] - held) <= ALLOWANCE
    bound = (_peak(resident) + disk["disk"]["ring_bytes"] + disk["plan"]["buffer_bytes"] + READER_STAGING
             + ALLOWANCE)
    assert _peak(disk) <= bound, (
        f"disk peak {_peak(disk) / MIB:.0f} MiB > small resident {_peak(resident) / MIB:.0f} MiB + ring + buffers + "
        f"reader staging + allowance = {bound / MIB:.0f} MiB")


def test_the_load_and_the_disk_tier_leave_nothing_in_the_page_cache(reports: dict[str, Report]) -> None:
    disk = reports["disk"]
    assert disk["cached_bytes"] == 0, (
        f"{disk['cached_bytes'] / MIB:.0f} MiB of the checkpoint in the page cache after the forward (it read "
        f"{disk['disk']['read_bytes'] / MIB:.0f} MiB from disk)")
