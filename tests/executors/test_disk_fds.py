"""The disk tier's open files: each file it reads is open once (and once more by the
reader, ``O_DIRECT``), however many of its tensors are on disk. A private mapping per
tensor held an fd per tensor (``mmap.mmap`` keeps a duplicate of the fd it is given for
the mapping's life): a 24-layer Llama with 18 layers on disk held 166."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from offload.pure.disk.tier import DiskSource
from offload.runtime.cpu import CpuRuntime
from tests.executors.disk_helpers import build_model, plan_tier, wrap
from tests.hf.checkpoints import save, step_logits


def _open_fds() -> int:
    gc.collect()  # what a test let go of closes now, not at some later collection
    return len(os.listdir("/proc/self/fd"))


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("sharded", "disk_layers"), [(False, 3), (False, 4), (True, 3)])
def test_each_file_is_open_once_whatever_the_number_of_tensors(tmp_path: Path, sharded: bool,
                                                              disk_layers: int) -> None:
    """Three or four layers on disk (nine tensors each): most mapped where they lie in the checkpoint, three
    changed after loading and so spilled. After wrap the tier holds one fd per checkpoint
    file it maps and the spill file's two (one to write, one to read with ``O_DIRECT``);
    after post_init and a forward the checkpoint files are open once each, by the reader,
    and the spill file still twice; after restore nothing is open, though the restored
    weights are still the tensors over the files' mappings."""
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=sharded)
    plan, tier, layers = plan_tier(model, checkpoint, disk_layers=disk_layers)
    changed = [p for p in tier.params if p.name.endswith("proj.weight")][:3]
    layer: Any
    with torch.no_grad():
        for p in changed:  # no longer the checkpoint's bytes: spilled at wrap
            layer = layers[p.layer]
            layer.get_parameter(p.name).mul_(2.0)
    want = step_logits(model)
    mapped = {p.extent.path for p in tier.params if p.source is DiskSource.CHECKPOINT and p.extent is not None
              and p not in changed}
    assert len(tier.params) == 9 * disk_layers and len(mapped) < len(tier.params) - len(changed)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()

    start = _open_fds()
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), spill_dir, start=False)
    assert _open_fds() - start == len(mapped) + 2
    offloader.post_init()
    assert _equal(step_logits(model), want)
    assert _open_fds() - start == len(mapped) + 2  # the reader's, one per checkpoint file; the spill file's two
    offloader.restore()
    assert _open_fds() == start
    assert _equal(step_logits(model), want)
