"""The prefetch executor running a disk tier (Note [disk tier]) against what can go wrong:
copies deferred until waited for (a played GPU: a staging buffer refilled before the copy
out of it ran would give a layer another layer's weights), layers out of order, a read
that fails and then works again, a checkpoint file changed after planning, a full spill
disk, CUDA graph capture, and a tier that is not the plan's (new weights for disk layers:
`tests/executors/test_disk_new_weights.py`)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from offload import ConfigError, ExecutionError, OffloadConfig, PlanError
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.prefetch.disk import DiskIO
from offload.hf import offload_model
from offload.pure.check import Location, render_check
from offload.runtime.cpu import CpuRuntime
from offload.runtime.diskio import DiskReader, FileOps
from offload.runtime.spill import SpillFile
from tests.executors.disk_helpers import build_model, plan_tier, read_per_pass, weights, wrap
from tests.executors.fakes import Copy, FakeEvent, FakeRuntime
from tests.hf.checkpoints import save, step_logits


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class DeferredRuntime(FakeRuntime):
    """A played GPU whose copies run only when waited for (the copy stream lags), safe for
    the disk reader's threads, which block on a copy's event (`HostWaits`) until the
    compute side's wait has run it."""

    def __init__(self) -> None:
        super().__init__(defer=True, device="cuda:0")
        self._lock = threading.Condition()
        self.blocked: list[int] = []  # the copies reads blocked on (whether or not they had run yet)

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: object) -> FakeEvent:
        with self._lock:
            return super().copy_chunks_after(chunks, after)

    def wait(self, event: object) -> None:
        with self._lock:
            super().wait(event)
            self._lock.notify_all()

    def synchronize(self) -> None:
        with self._lock:
            super().synchronize()
            self._lock.notify_all()

    def block_on(self, event: object) -> None:
        assert isinstance(event, FakeEvent)
        with self._lock:
            self.blocked.append(event.number)
            self._lock.wait_for(lambda: not self._pending(event), timeout=30)
            assert not self._pending(event), "the copy out of a staging buffer never ran"

    def _pending(self, event: FakeEvent) -> bool:
        return any(done == event for done, _, _ in self._queue)


@pytest.mark.parametrize("read_ahead", [1, 2, 3])
def test_copies_that_lag_never_read_a_refilled_staging_buffer(tmp_path: Path, read_ahead: int) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=True)
    want = step_logits(model)
    plan, tier, layers = plan_tier(model, checkpoint, read_ahead=read_ahead)
    rt = DeferredRuntime()
    offloader = wrap(model, layers, plan, tier, rt, tmp_path)
    assert _equal(step_logits(model), want)
    # Every refill of a staging buffer waited for the copy out of it (with one buffer,
    # every read after the first; the copies lag until their layer waits for them).
    copies = {entry.done.number for entry in rt.entries(Copy)}
    assert rt.blocked and set(rt.blocked) <= copies
    assert len(rt.blocked) >= offloader.stats().steps * (len(tier.disk_positions) - tier.buffers)
    offloader.restore()


def test_layers_out_of_order_still_get_their_own_weights(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    want = step_logits(model)
    plan, tier, layers = plan_tier(model, checkpoint)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path)
    # A forward that stops part way, at a layer on disk: the next one realigns.
    stop_at: Any = layers[tier.disk_layers[1]]

    def stop(*_: object) -> None:
        raise RuntimeError("stopped part way")

    handle = stop_at.register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stopped part way"):
        step_logits(model, steps=1)
    handle.remove()
    assert _equal(step_logits(model), want)
    stats = offloader.stats()
    assert stats.realignments >= 1 and stats.disk_misses >= 1  # the realigned copies read on the spot
    offloader.restore()


def test_a_failed_read_names_the_file_and_the_next_forward_reads_again(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    want = step_logits(model)
    plan, tier, layers = plan_tier(model, checkpoint)
    failing = threading.Event()

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if failing.is_set():
            raise OSError(errno.EIO, "injected read error")
        return os.preadv(fd, buffers, offset)

    io = DiskIO(reader=lambda: DiskReader(threads=2, ops=FileOps(preadv=preadv)))
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, io)
    assert _equal(step_logits(model, steps=1), want[:1])
    failing.set()
    with pytest.raises(ExecutionError) as caught:
        for _ in range(3):  # the reads staged before the fault may still succeed
            step_logits(model, steps=1)
    assert "model.safetensors" in str(caught.value) and "injected read error" in str(caught.value)
    failing.clear()
    assert _equal(step_logits(model), want)
    offloader.restore()


def test_a_checkpoint_file_changed_after_planning_is_refused(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint)
    before = weights(model)
    file = checkpoint / "model.safetensors"
    os.utime(file, ns=(0, 0))  # the mtime planned no longer holds
    with pytest.raises(ExecutionError, match="changed after the disk tier was planned.*mtime_ns"):
        wrap(model, layers, plan, tier, CpuRuntime(), tmp_path)
    assert all(torch.equal(p, before[name]) for name, p in weights(model).items())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_checkpoint_file_changed_before_post_init_is_refused(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    want = step_logits(model)
    plan, tier, layers = plan_tier(model, checkpoint)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, start=False)
    os.utime(checkpoint / "model.safetensors", ns=(0, 0))
    with pytest.raises(ExecutionError, match="post_init.*changed after the disk tier was planned"):
        offloader.post_init()
    offloader.restore()
    assert _equal(step_logits(model), want)


def test_a_full_spill_disk_leaves_the_model_as_it_was_and_nothing_on_disk(tmp_path: Path) -> None:
    model = build_model("llama")
    want = step_logits(model)
    before = weights(model)
    plan, tier, layers = plan_tier(model, None)  # everything on disk is spilled
    writes = [0]

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        writes[0] += 1
        if writes[0] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data, offset)

    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    io = DiskIO(spill=lambda directory: SpillFile(directory, pwrite=pwrite))
    with pytest.raises(ExecutionError, match="No space left on device"):
        wrap(model, layers, plan, tier, CpuRuntime(), spill_dir, io)
    assert writes[0] == 4
    assert list(spill_dir.iterdir()) == []
    assert all(torch.equal(p, before[name]) for name, p in weights(model).items())
    assert _equal(step_logits(model), want)
    # And it offloads afterwards.
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), spill_dir)
    assert _equal(step_logits(model), want)
    offloader.restore()
    assert list(spill_dir.iterdir()) == []


def test_a_cuda_graph_capture_is_refused(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint, config=OffloadConfig(group_size=6, num_in_group=5))
    rt = FakeRuntime(device="cuda:0")
    offloader = wrap(model, layers, plan, tier, rt, tmp_path)
    offloader.sync_prev_onload()
    rt.capturing = True
    with pytest.raises(ExecutionError, match="cannot capture a CUDA graph of a model with a disk tier"):
        step_logits(model, steps=1)
    rt.capturing = False
    offloader.restore()


def test_a_tier_of_another_plan_is_refused(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    _, tier, _ = plan_tier(model, checkpoint)
    other, _, _ = plan_tier(model, checkpoint, config=OffloadConfig(group_size=6, num_in_group=3))
    with pytest.raises(PlanError, match="the disk tier"):
        PrefetchOffloader(other, CpuRuntime(), disk=tier, spill_dir=tmp_path)


def test_a_spilling_tier_without_a_spill_dir_is_refused_by_name(tmp_path: Path) -> None:
    model = build_model("llama")
    plan, tier, _ = plan_tier(model, None)
    with pytest.raises(ExecutionError, match="no spill_dir was given") as caught:
        PrefetchOffloader(plan, CpuRuntime(), disk=tier)
    assert caught.value.name == "spill_dir"


@pytest.mark.parametrize("option", ["checkpoint", "spill_dir", "disk_gbps", "read_ahead"])
def test_disk_options_without_a_host_budget_are_refused_by_name(tmp_path: Path, option: str) -> None:
    model = build_model("llama")
    values: dict[str, Any] = {"checkpoint": tmp_path, "spill_dir": tmp_path, "disk_gbps": 2.0, "read_ahead": 3}
    call: Callable[..., Any] = offload_model
    with pytest.raises(ConfigError, match=f"{option} is a disk tier option") as caught:
        call(model, OffloadConfig(group_size=2), runtime=CpuRuntime(), **{option: values[option]})
    assert caught.value.name == option


@pytest.mark.parametrize("way", ["parameter", "state_dict", "data"])
def test_a_disk_weight_written_before_post_init_is_copied_again(tmp_path: Path, way: str) -> None:
    """Post-processing that writes a disk weight in place between wrap and post_init: its
    copy maps the checkpoint privately, so the write is not in the file the reads come
    from; post_init sees it (the version counters; through ``param.data``, which moves
    none, the pages copied on write) and spills the weight as it is now."""
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, start=False)
    layer: Any = layers[tier.disk_layers[-1]]
    with torch.no_grad():
        if way == "parameter":
            layer.mlp.up_proj.weight.mul_(2.0)
        elif way == "data":
            layer.mlp.up_proj.weight.data.mul_(2.0)  # a fresh version counter: only the pages tell
        else:
            model.state_dict()[f"model.layers.{tier.disk_layers[-1]}.mlp.up_proj.weight"].mul_(2.0)
    # The resident model computing with the doubled weight is what the offloaded one must equal.
    reference = build_model("llama")
    with torch.no_grad():
        reference.model.layers[tier.disk_layers[-1]].mlp.up_proj.weight.mul_(2.0)
    want = step_logits(reference)
    offloader.post_init()
    assert _equal(step_logits(model), want)
    offloader.restore()
    assert torch.equal(layer.mlp.up_proj.weight, reference.model.layers[tier.disk_layers[-1]].mlp.up_proj.weight)


@pytest.mark.parametrize(("read_ahead", "disk_layers"), [(1, 2), (2, 3), (3, 5)])
def test_each_pass_reads_each_disk_layer_once(tmp_path: Path, read_ahead: int, disk_layers: int) -> None:
    """However many disk layers there are for the ring (not a multiple of its buffers but
    for one buffer), a pass reads each layer that shares its buffer once, and a layer
    alone in its buffer stays there: staging ahead never reads over a layer the pass
    still needs."""
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint, read_ahead=read_ahead, disk_layers=disk_layers)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path)
    step_logits(model)
    offloader.restore()  # the reads staged ahead for a next pass finish
    stats = offloader.stats()
    size = {p.layer: 0 for p in tier.params}
    for p in tier.params:
        size[p.layer] += p.nbytes
    # Every copy found its layer staged ahead; each pass read the layers sharing a buffer
    # (and the last one staged those of a next pass).
    assert stats.disk_misses == 0
    per_pass = read_per_pass(tier)
    assert per_pass >= 2 * min(size.values()) and stats.steps > 1
    assert stats.steps * per_pass <= stats.disk_bytes_read <= (stats.steps + 1) * per_pass + tier.disk_bytes


def test_the_live_check_shows_disk_placements_and_whether_each_file_is_as_planned(tmp_path: Path) -> None:
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=True)
    plan, tier, layers = plan_tier(model, checkpoint)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, start=False)
    disk = {(p.layer, p.name) for p in tier.params}
    before = offloader.check()
    assert before.ok, render_check(before)
    assert {(p.layer, p.name) for p in before.params if p.actual is Location.DISK} == disk
    assert set(before.disk_params) == disk and {f.path for f in before.files} == {f.path for f in tier.files}
    offloader.post_init()
    after = offloader.check()
    assert after.ok and all(p.actual is Location.SLOT for p in after.params if (p.layer, p.name) in disk)
    changed = tier.files[0].path
    os.utime(changed, ns=(0, 0))
    stale = offloader.check()
    assert not stale.ok and [(f.path, f.changes) for f in stale.changed_files] == [(changed, ("mtime_ns",))]
    assert f"file {changed}: mtime_ns changed" in render_check(stale)
    offloader.restore()


def test_a_model_on_meta_with_a_disk_weight_to_spill_is_refused_naming_it(tmp_path: Path) -> None:
    """Wrapping on meta maps the disk weights read from the checkpoint; one that would go to
    the spill file has no values yet to write there: refused by name, nothing moved."""
    with torch.device("meta"):
        model = build_model("llama")
    plan, tier, layers = plan_tier(model, None)  # no checkpoint: every disk weight is to be spilled
    offloader = PrefetchOffloader(plan, CpuRuntime(), disk=tier, spill_dir=tmp_path)
    first = tier.params[0]
    with pytest.raises(ExecutionError, match=rf"layer {first.layer} parameter '{first.name}' is on meta and goes to "
                                             "the spill file"):
        offloader.wrap_modules(layers)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert list(tmp_path.iterdir()) == []


def test_a_weight_written_through_data_is_told_from_the_others_in_its_mapping(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint file is mapped whole, many disk weights in one mapping: a write through
    ``param.data`` into one of them is found by its own pages, so post_init copies again
    that weight and at most the neighbours it shares a page with in the file, not every
    weight of the file."""
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint, disk_layers=3)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, start=False)
    target = next(p for p in tier.params if p.name == "mlp.up_proj.weight")
    assert target.extent is not None
    page = mmap.PAGESIZE

    def pages(offset: int, nbytes: int) -> set[int]:
        return set(range(offset // page, (offset + nbytes - 1) // page + 1))

    edges = {target.extent.offset // page, (target.extent.offset + target.nbytes - 1) // page}
    near = {(p.layer, p.name) for p in tier.params if p.extent is not None and p is not target
            and pages(p.extent.offset, p.nbytes) & edges}
    layer: Any = layers[target.layer]
    with torch.no_grad():
        layer.mlp.up_proj.weight.data.mul_(2.0)  # moves no version counter: only its pages tell
    reference = build_model("llama")
    with torch.no_grad():
        reference.model.layers[target.layer].mlp.up_proj.weight.mul_(2.0)
    with caplog.at_level(logging.INFO, logger="offload.disk"):
        offloader.post_init()
    found = [r.getMessage() for r in caplog.records if "written before post_init" in r.getMessage()]
    assert len(found) == 1 and len(tier.params) > 1 + len(near)
    count = int(found[0].split()[0])
    assert 1 <= count <= 1 + len(near), found
    assert _equal(step_logits(model), step_logits(reference))
    offloader.restore()
