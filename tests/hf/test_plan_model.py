"""`plan_model`, the planning step of `offload_model`: a config as given, or `fit` for a
device budget counting the weights outside the layers as resident."""

from __future__ import annotations

import attrs
import pytest

from offload import ConfigError, EnvSnapshot, OffloadConfig, Platform, describe_layers, make_plan
from offload.hf import find_layers, plan_model
from offload.hf.model import outside_tensors
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import PROFILES
from offload.pure.fit.search import fit
from tests.hf.checkpoints import build

GPU = Platform(has_cuda=True, device_name="fake CUDA device", device_total_bytes=80 << 30,
               can_map_host_memory=True, can_register_host_memory=True, host_pointer_for_registered_memory=True)
ON_GPU = EnvSnapshot(platform=GPU)
ON_CPU = EnvSnapshot()


def test_a_config_is_planned_as_given() -> None:
    model = build("llama")
    spec = describe_layers(list(find_layers(model)))
    config = OffloadConfig(group_size=2, prefetch_step=1)
    assert plan_model(spec, ON_GPU, config=config, device_budget_bytes=None, outside_bytes=0) == make_plan(
        spec, config, ON_GPU)


def test_config_and_budget_together_are_refused() -> None:
    model = build("llama")
    spec = describe_layers(list(find_layers(model)))
    with pytest.raises(ConfigError, match="not both") as info:
        plan_model(spec, ON_GPU, config=OffloadConfig(group_size=1), device_budget_bytes=1 << 20, outside_bytes=0)
    assert info.value.name == "config"


def test_without_an_accelerator_a_config_or_a_budget_is_needed() -> None:
    model = build("llama")
    spec = describe_layers(list(find_layers(model)))
    with pytest.raises(ConfigError, match="no accelerator") as info:
        plan_model(spec, ON_CPU, config=None, device_budget_bytes=None, outside_bytes=0)
    assert info.value.name == "device_budget_bytes"


def test_the_budget_counts_the_weights_outside_the_layers() -> None:
    model = build("llama")
    layers = list(find_layers(model))
    spec = describe_layers(layers)
    outside = sum(t.numel() * t.element_size() for _, t in outside_tensors(model, layers))
    assert outside > 0  # embeddings and head: the test means something
    # A budget that holds every layer but not the layers and the outside weights together.
    budget = spec.nbytes + outside // 2
    plan = plan_model(spec, ON_GPU, config=None, device_budget_bytes=budget, outside_bytes=outside)
    assert plan.offloaded_params, "the outside weights did not count: everything stayed resident"
    assert plan.device_bytes_resident + plan.device_bytes_buffers + outside <= budget
    # Without them, everything would have fitted resident.
    assert not plan_model(spec, ON_GPU, config=None, device_budget_bytes=budget, outside_bytes=0).offloaded_params


def test_a_budget_on_a_machine_without_an_accelerator_runs_the_fit_configuration_here() -> None:
    model = build("llama")
    layers = list(find_layers(model))
    spec = describe_layers(layers)
    outside = sum(t.numel() * t.element_size() for _, t in outside_tensors(model, layers))
    budget = spec.nbytes // 2 + outside
    plan = plan_model(spec, ON_CPU, config=None, device_budget_bytes=budget, outside_bytes=outside)
    assert plan.compute_device == "cpu"
    chosen = fit(spec, ON_CPU, PROFILES["h200-pcie5"], Workload(), budget, outside_bytes=outside).chosen.config
    assert plan == make_plan(spec, chosen, ON_CPU)
    assert plan.offloaded_params


@pytest.mark.parametrize("env", [ON_GPU, ON_CPU], ids=["gpu", "cpu"])
def test_a_budget_plans_what_fit_chose_even_when_it_left_the_expert_caches_out(env: EnvSnapshot) -> None:
    """Four MoE layers where streaming them whole is what fits: the plan that runs has no
    caches, as fit chose (the expert options were laid over its choice, turning the caches
    back on, twice the budget's device bytes)."""
    from offload.hf.model import BudgetExperts
    from offload.pure.experts.profile import trace_profile
    from offload.pure.experts.replay import zipf_trace
    from tests.pure.fit.test_search import TOY
    from tests.pure.fit.test_search_experts import NO_UVA, moe_spec

    spec = moe_spec([(16, 4)] * 4, hidden=8, ffn=4, top_k=1)
    chosen = fit(spec, NO_UVA, TOY, Workload(), 1600)
    assert chosen.chosen.config.backend == "prefetch" and not chosen.chosen.config.expert_cache
    profile = trace_profile(zipf_trace(spec.experts, steps=4, top_k=1))
    for experts in (BudgetExperts(), BudgetExperts(routing_profile=profile)):
        plan = plan_model(spec, attrs.evolve(env, flags=NO_UVA.flags), config=None, device_budget_bytes=1600,
                          outside_bytes=0, profile=TOY, experts=experts)
        assert plan.config.expert_cache is False and plan.experts == ()
        assert plan.config.group_size == chosen.chosen.config.group_size
