"""A spill directory is checked when it is given, whether or not the plan spills: one that
does not exist, is a file, or cannot take a file is refused at once with its path, the
model as it was; a tier that spills more than the directory's filesystem has free is
refused before anything is written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from offload.cli import main
from offload.errors import ConfigError, PlanError
from offload.hf import offload_model
from offload.hf.disk import DiskRequest, check_spill_dir, plan_model_disk, spill_room
from offload.hf.layers import find_stacks
from offload.model.describe import describe_stacks
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.plan.make import make_plan
from offload.runtime.cpu import CpuRuntime
from tests.hf.checkpoints import build, save

PLAN = OffloadConfig(group_size=1, prefetch_step=1)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot make a file in: one with mode 0o500 where that
    stops us (not root), else a read-only mount (``/sys`` on these machines)."""
    closed = tmp_path / "closed"
    closed.mkdir()
    closed.chmod(0o500)
    for candidate in (closed, Path("/sys")):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    raise AssertionError("no directory refuses a new file on this machine")


@pytest.mark.parametrize("kind", ["missing", "file", "unwritable"])
def test_a_bad_spill_dir_is_refused_even_when_nothing_would_spill(tmp_path: Path, kind: str) -> None:
    model = build("llama")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    bad = {"missing": tmp_path / "no-such-dir", "file": tmp_path / "a-file",
           "unwritable": _unwritable_dir(tmp_path)}[kind]
    if kind == "file":
        bad.write_text("x")
    with pytest.raises(ConfigError) as caught:
        # A host budget that holds every offloaded weight: the tier would spill nothing.
        offload_model(model, PLAN, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=1 << 30,
                      spill_dir=bad)
    assert caught.value.name == "spill_dir" and caught.value.value == str(bad)
    assert repr(str(bad)) in caught.value.message
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    assert list(tmp_path.glob("**/.offload-probe-*")) == []


def test_a_good_spill_dir_is_left_as_it_was(tmp_path: Path) -> None:
    check_spill_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_tier_that_spills_more_than_the_disk_has_free_is_refused_naming_both(tmp_path: Path) -> None:
    model = build("llama")
    stacks = find_stacks(model)
    layers = [layer for stack in stacks for layer in stack]
    plan = make_plan(describe_stacks(stacks), PLAN, EnvSnapshot())
    budget = plan.host_bytes * 3 // 4  # a layer or two on disk, spilled (no checkpoint)
    request = DiskRequest(host_budget_bytes=budget, spill_dir=tmp_path)
    tier = plan_model_disk(model, layers, plan, EnvSnapshot(), request, free_bytes=lambda _: 1 << 40)
    assert tier is not None and tier.spill_bytes > 0
    need = spill_room(tier)
    assert need >= tier.spill_bytes
    with pytest.raises(PlanError) as caught:
        plan_model_disk(model, layers, plan, EnvSnapshot(), request, free_bytes=lambda _: need - 1)
    assert caught.value.name == "spill_dir" and caught.value.value == str(tmp_path)
    assert f"({need - 1} bytes)" in caught.value.message and f"({need} bytes)" in caught.value.message
    assert plan_model_disk(model, layers, plan, EnvSnapshot(), request, free_bytes=lambda _: need) == tier


def test_offload_load_with_a_mistyped_spill_dir_exits_2_naming_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    save(build("llama"), tmp_path / "ckpt", sharded=False)
    typo = tmp_path / "scrach"
    code = main(["load", str(tmp_path / "ckpt"), "--host-gib", "1", "--spill-dir", str(typo)])
    err = capsys.readouterr().err
    assert code == 2
    assert str(typo) in err and "does not exist" in err
