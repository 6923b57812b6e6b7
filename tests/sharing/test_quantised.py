"""A sharing group refuses quantised weights (tensor subclasses offloaded by their inner
tensors, `offload.model.wrappers`) on every member, before anything is shared or moved:
each member holds the same model and refuses alone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload import EnvSnapshot, ExecutionError, OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.runtime.cpu import CpuRuntime
from offload.sharing import ShareWith, share_offloader
from offload.sharing.coordinate import Membership
from tests.model.test_subclass_params import _quantised_linear
from tests.sharing.members import run_members

PATIENT_S = 10.0


def test_every_member_refuses_quantised_weights_before_anything_moves() -> None:
    def member(rank: int, membership: Membership) -> tuple[str, bool]:
        torch.manual_seed(0)
        layers = nn.ModuleList([_quantised_linear(), _quantised_linear()])
        before = [(n, id(p)) for n, p in layers.named_parameters()]
        classes = [type(m) for m in layers.modules()]
        plan: OffloadPlan = make_plan(describe_layers(layers), OffloadConfig(group_size=1), EnvSnapshot())
        offloader = share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=PATIENT_S), membership=membership)
        try:
            offloader.wrap_modules(list(layers))
        except ExecutionError as exc:
            same = [(n, id(p)) for n, p in layers.named_parameters()] == before and \
                [type(m) for m in layers.modules()] == classes
            return str(exc), same
        raise AssertionError("wrap_modules did not refuse")

    outcomes = run_members(2, member)
    results: list[Any] = [outcome.get() for outcome in outcomes]
    for message, same in results:
        assert message.startswith("a sharing group cannot offload quantised weights")
        assert same
