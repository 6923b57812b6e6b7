"""Every offloader a public function returns keeps the whole `Offloader` protocol, each
method called, not only ``isinstance``: `create_offloader` (prefetch, UVA, none),
`share_offloader`, `offload_model`, `offload_pretrained` (loaded on the host, and
streamed with a host budget) and `offload_pipeline`. Each one runs as the resident model
did, takes new weights (`load_weights`) and then computes as a resident model given them,
checks clean, counts, and gives every weight back on `restore`, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offload import EnvSnapshot, OffloadConfig, OffloadPlan, create_offloader, describe_layers, make_plan
from offload.protocols import Offloader
from offload.pure.check import LiveCheck
from offload.pure.stats import OffloadStats
from offload.runtime.cpu import CpuRuntime
from tests.executors.models import HIDDEN, transformer_model

#: Every member of the protocol: a test below calls each of them.
MEMBERS = sorted(name for name in vars(Offloader) if not name.startswith("_"))


def test_the_members_are_the_ones_this_file_calls() -> None:
    assert MEMBERS == ["check", "join_after_forward", "load_weights", "plan", "post_init", "restore",
                       "stats", "sync_prev_onload", "wrap_modules"]


def _changed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New weights: every floating-point tensor scaled (exactly representable), the rest kept."""
    return {name: (t * 1.5 if t.is_floating_point() else t.clone()) for name, t in state.items()}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))


def exercise(offloader: Offloader, model: nn.Module, run: Callable[[nn.Module], Any], *,
             layers: list[nn.Module] | None, names: Callable[[nn.Module], dict[str, torch.Tensor]]) -> None:
    """Call every member of the protocol on `offloader` of `model` and check what each does.

    Args:
        offloader: from a public function; wrapped and ready already when `layers` is None.
        model: what it offloads (a resident copy is made before wrapping, where it wraps here).
        run: one forward of a model (the output compared bit for bit).
        layers: the layers to `wrap_modules`, or None when the function wrapped them.
        names: the weights `load_weights` takes, by the names it takes them (from a model).
    """
    assert isinstance(offloader, Offloader)
    assert all(callable(getattr(offloader, name)) for name in MEMBERS if name != "plan")
    assert isinstance(offloader.plan, OffloadPlan)
    if layers is not None:
        twin = copy.deepcopy(model)
        wrapped = offloader.wrap_modules(layers)
        assert [id(m) for m in wrapped] == [id(m) for m in layers]
        offloader.post_init()
    else:
        twin = None
    expected = run(twin) if twin is not None else None
    first = run(model)
    if expected is not None:
        assert _equal(first, expected)
    offloader.sync_prev_onload()
    offloader.join_after_forward()  # outside a capture: nothing outstanding to join
    assert _equal(run(model), first)

    resident = copy.deepcopy(twin) if twin is not None else None
    new = _changed(names(model if resident is None else resident))
    offloader.load_weights(new)
    after = run(model)
    assert not _equal(after, first)
    if resident is not None:
        resident.load_state_dict(new, strict=False)  # the names are the model's own (a Sequential's "0.x")
        assert _equal(after, run(resident))

    found = offloader.check()
    assert isinstance(found, LiveCheck)
    assert found.differences == ()
    counted = offloader.stats()
    assert isinstance(counted, OffloadStats)
    if offloader.plan.offloaded_params and offloader.plan.backend.value == "prefetch":
        assert counted.copies_issued > 0 and counted.bytes_copied > 0
    offloader.restore()
    back = names(model)
    for name, tensor in new.items():
        assert torch.equal(back[name], tensor), name
    assert _equal(run(model), after)  # restored, with the new weights, as it computed offloaded


def _layers_model() -> nn.Sequential:
    return transformer_model(4, seed=0)


def _layers_run(model: nn.Module) -> torch.Tensor:
    x = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out: torch.Tensor = model(x)
    return out


def _layer_names(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(nn.ModuleList(list(model.children())).named_parameters())


@pytest.mark.parametrize("config", [OffloadConfig(group_size=2, prefetch_step=1), OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
                                    OffloadConfig(backend="none")], ids=["prefetch", "uva", "none"])
def test_create_offloader(config: OffloadConfig) -> None:
    model = _layers_model()
    plan = make_plan(describe_layers(list(model)), config, EnvSnapshot())
    exercise(create_offloader(plan, CpuRuntime()), model, _layers_run, layers=list(model), names=_layer_names)


def test_share_offloader_alone_in_its_group() -> None:
    from offload.sharing import ShareWith, share_offloader
    from offload.sharing.coordinate import Membership
    from tests.sharing.members import run_members

    def member(rank: int, membership: Membership) -> bool:
        model = _layers_model()
        plan = make_plan(describe_layers(list(model)), OffloadConfig(group_size=1), EnvSnapshot())
        offloader = share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=10.0), membership=membership)
        exercise(offloader, model, _layers_run, layers=list(model), names=_layer_names)
        return True

    assert [outcome.get() for outcome in run_members(1, member)] == [True]


def _hf_run(model: nn.Module) -> Any:
    from tests.hf.checkpoints import step_logits

    return step_logits(model, steps=2)  # type: ignore[arg-type]


def _model_names(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _resident_twin_check(model: nn.Module, offloader: Offloader, resident: nn.Module) -> None:
    """For functions that wrap themselves: the offloaded model computes as `resident`."""
    assert _equal(_hf_run(model), _hf_run(resident))
    exercise(offloader, model, _hf_run, layers=None, names=_model_names)


def test_offload_model() -> None:
    from offload.hf import offload_model
    from tests.hf.checkpoints import build

    model = build("llama")
    resident = copy.deepcopy(model)
    offloader = offload_model(model, OffloadConfig(group_size=2, prefetch_step=1), env=EnvSnapshot(),
                              runtime=CpuRuntime())
    _resident_twin_check(model, offloader, resident)


@pytest.mark.parametrize("streamed", [False, True], ids=["on-host", "streamed"])
def test_offload_pretrained(tmp_path: Path, streamed: bool) -> None:
    from offload.hf import offload_pretrained
    from tests.hf.checkpoints import build, save

    resident = build("llama")
    save(resident, tmp_path / "ckpt", sharded=True)
    options: dict[str, Any] = {"host_budget_bytes": 1 << 30, "spill_dir": tmp_path} if streamed else {}
    model, offloader = offload_pretrained(tmp_path / "ckpt", OffloadConfig(group_size=2, prefetch_step=1),
                                          env=EnvSnapshot(), runtime=CpuRuntime(), **options)
    _resident_twin_check(model, offloader, resident)


def test_offload_pipeline() -> None:
    from offload.diffusers import offload_pipeline
    from tests.diffusers.test_pipeline import _image, _pipeline

    pipe = _pipeline()
    resident = _image(pipe)
    offloader = offload_pipeline(pipe, OffloadConfig(group_size=1, prefetch_step=1), env=EnvSnapshot(),
                                 runtime=CpuRuntime())
    holder = offloader.model
    assert torch.equal(_image(pipe), resident)
    exercise(offloader, holder, lambda _: _image(pipe), layers=None, names=_model_names)
