"""Quantised weights (torchao's int8 and float8 tensor subclasses) offloaded by their inner
tensors (`offload.model.wrappers`, `offload.executors.placement.unpack`): a quantised
Llama's every greedy `generate` step bit for bit equal to the resident quantised model's
with prefetch and with on-demand; the wrapper computes over the slots (prefetch) or the
copies made for the call (on demand), never over the host copies; ``state_dict`` gives
the weights under their own names; `restore` gives back the same wrapper objects, bit for
bit, with each module's class and parameter order; a failed wrap leaves the model as it
was; a conversion goes to the wrapper, as on the resident model; `offload_pretrained`
quantises at load through transformers' own torchao integration in the same call."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchao.quantization import (
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from transformers import AutoModelForCausalLM, PreTrainedModel, TorchAoConfig

from offload import EnvFlags, EnvSnapshot, ExecutionError, OffloadConfig, Placement, PlanError, describe_layers
from offload.hf import find_layers, offload_model, offload_pretrained
from offload.model.wrappers import is_wrapper
from offload.pure.check import Location
from tests.executors.fakes import FakeRuntime
from tests.executors.faults import FaultyRuntime, make_error
from tests.executors.helpers import CUDA_LIKE, cpu_plan, prefetch
from tests.executors.models import layer_list
from tests.hf.checkpoints import VOCAB, build, save, step_logits

STEPS = 4

QUANTISE: dict[str, Callable[[], Any]] = {
    "int8-weight-only": Int8WeightOnlyConfig,
    "int8-dynamic": Int8DynamicActivationInt8WeightConfig,
    "intx-weight-only": IntxWeightOnlyConfig,
    "float8-weight-only": Float8WeightOnlyConfig,
}

BACKENDS = {
    "prefetch": OffloadConfig(group_size=1, prefetch_step=2),
    "on-demand": OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
}


def _quantised(scheme: str) -> PreTrainedModel:
    """The small Llama in bfloat16, its layers' projections quantised with `scheme`."""
    model: Any = build("llama")
    model.to(torch.bfloat16)
    model.eval()
    quantize_(model.model.layers, QUANTISE[scheme]())
    quantised: PreTrainedModel = model
    return quantised


def _wrappers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if is_wrapper(p)]


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(tensor, n) for n in names]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: a wrapper's inner tensors, or the tensor's own values."""
    if is_wrapper(a) or is_wrapper(b):
        return type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(_inner(a), _inner(b), strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("scheme", sorted(QUANTISE))
def test_every_generate_step_equals_the_resident_quantised_model(scheme: str, backend: str) -> None:
    reference = _quantised(scheme)
    model = copy.deepcopy(reference)
    wrappers = _wrappers(model)
    assert len(wrappers) == 4 * 7  # the premise: every projection of every layer is a tensor subclass
    classes = {name: type(module) for name, module in model.named_modules()}
    order = [name for name, _ in model.named_parameters()]
    inner_ptrs = {name: [t.data_ptr() for t in _inner(w)] for name, w in wrappers}
    off = offload_model(model, BACKENDS[backend])
    # Every inner tensor of every layer is offloaded, and nothing else was left out.
    offloaded = {(p.layer, p.name) for p in off.plan.offloaded_params}
    assert {p.placement for p in off.plan.offloaded_params} == {
        Placement.PREFETCH if backend == "prefetch" else Placement.ON_DEMAND}
    expected = {(i, n) for i, layer in enumerate(describe_layers(find_layers(reference)).layers)
                for n in (p.name for p in layer.params)}
    assert offloaded == expected
    assert any(".parametrizations.weight.original" in name for _, name in offloaded)
    want = step_logits(reference)
    got = step_logits(model)
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{scheme} {backend}: step {step} differs by {(a - b).abs().max().item()}"
    # state_dict: the weights under their own names, as the resident model gives them.
    state, ref_state = model.state_dict(), reference.state_dict()
    assert sorted(state) == sorted(ref_state)
    assert all(_equal(state[key], ref_state[key]) for key in ref_state)
    off.restore()
    assert {name: type(module) for name, module in model.named_modules()} == classes
    assert [name for name, _ in model.named_parameters()] == order
    after = dict(model.named_parameters())
    for name, wrapper in wrappers:
        assert after[name] is wrapper  # the same object, over its inner tensors' old memory
        assert [t.data_ptr() for t in _inner(wrapper)] == inner_ptrs[name]
        assert all(type(t) is torch.Tensor for t in _inner(wrapper))
    assert all(_equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                            strict=True))
    assert all(torch.equal(a, b) for a, b in zip(step_logits(model), want, strict=True))


@pytest.mark.parametrize("placement", [Placement.PREFETCH, Placement.UVA, Placement.ON_DEMAND], ids=str)
def test_on_a_played_gpu_the_wrapper_computes_over_what_the_placement_gives(placement: Placement) -> None:
    """On a played CUDA device (host and device told apart): in every call of a quantised
    projection its weight's inner tensors are device memory, a slot or the copy made for
    the call, never the host copies (prefetch, on demand), or the host copies themselves,
    read in place (UVA); and the logits are the resident model's."""
    reference = _quantised("int8-weight-only")
    model = copy.deepcopy(reference)
    runtime = FakeRuntime(device="cuda:0")
    env = EnvSnapshot(flags=EnvFlags(disable_uva=placement is Placement.ON_DEMAND), platform=CUDA_LIKE)
    config = BACKENDS["prefetch" if placement is Placement.PREFETCH else "on-demand"]
    off = offload_model(model, config, env=env, runtime=runtime)
    assert {p.placement for p in off.plan.offloaded_params} == {placement}
    seen: list[bool] = []

    def look(module: Any, args: Any) -> None:
        seen.append(all(runtime.on_device(t) for t in _inner(module.weight)))

    handles = [module.register_forward_pre_hook(look) for module in model.model.layers.modules()
               if isinstance(module, nn.Linear)]
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    for handle in handles:
        handle.remove()
    assert torch.equal(got, want)
    assert len(seen) == 4 * 7
    assert seen == [placement is not Placement.UVA] * len(seen)
    off.restore()


def test_a_failed_wrap_leaves_the_quantised_model_as_it_was() -> None:
    model = _quantised("int8-weight-only")
    reference = copy.deepcopy(model)
    classes = {name: type(module) for name, module in model.named_modules()}
    params = list(model.named_parameters())
    runtime = FaultyRuntime(FakeRuntime(device="cuda:0"))
    runtime.arm("host_copy", 5, lambda: make_error("runtime", "host_copy", 5))
    with pytest.raises(ExecutionError, match="model left as it was"):
        offload_model(model, BACKENDS["prefetch"], env=EnvSnapshot(flags=EnvFlags(), platform=CUDA_LIKE),
                      runtime=runtime)
    assert runtime.fired is not None
    assert {name: type(module) for name, module in model.named_modules()} == classes
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]
    # The same wrappers (copied back from the page-locked copies made before the failure,
    # as plain weights are), over plain inner tensors, bit for bit.
    assert all(type(t) is torch.Tensor for _, w in _wrappers(model) for t in _inner(w))
    assert all(_equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                            strict=True))
    off = offload_model(model, BACKENDS["prefetch"])  # and it offloads afterwards
    assert all(torch.equal(a, b) for a, b in zip(step_logits(model), step_logits(reference), strict=True))
    off.restore()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_conversion_goes_to_the_wrapper_as_on_the_resident_model(backend: str) -> None:
    """torchao's wrappers keep their inner dtypes through ``.to(dtype)``: a cast of the
    offloaded quantised projections leaves them as the resident model's cast does (not
    their scales cast one by one); a move that would change them (to the meta device) is
    refused, naming the weight. (Casting the plain weights offloaded on demand is refused
    on its own, at the next forward: `test_changed_after_post_init`.)"""
    reference = _quantised("int8-weight-only")
    model = copy.deepcopy(reference)
    off = offload_model(model, BACKENDS[backend])
    for name, resident in reference.named_modules():
        if isinstance(resident, nn.Linear) and is_wrapper(resident.weight):
            resident.to(torch.float16)
            model.get_submodule(name).to(torch.float16)
    state, ref_state = model.state_dict(), reference.state_dict()
    assert sorted(state) == sorted(ref_state)
    assert all(_equal(state[key], ref_state[key]) for key in ref_state)
    assert all(torch.equal(a, b) for a, b in zip(step_logits(model), step_logits(reference), strict=True))
    with pytest.raises(ExecutionError, match=r"cannot convert the quantised weight 'self_attn\.q_proj\.weight'"):
        model.model.layers.to("meta")
    off.restore()
    assert all(type(w) is not nn.Parameter and w.device.type == "cpu" for _, w in _wrappers(model))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_offload_pretrained_quantises_at_load_through_transformers_and_offloads_in_one_call(
        backend: str, tmp_path: Path) -> None:
    """``quantization_config=TorchAoConfig(...)`` goes to ``from_pretrained`` as any other
    keyword: the model loads quantised into host memory, and its inner tensors offload."""
    path = save(build("llama"), tmp_path, sharded=True)
    quantised = TorchAoConfig(Int8WeightOnlyConfig())
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantised, local_files_only=True)
    reference: PreTrainedModel = loaded.eval()
    assert len(_wrappers(reference)) == 4 * 7
    model, off = offload_pretrained(path, BACKENDS[backend], quantization_config=quantised)
    assert sum(".parametrizations.weight.original" in p.name for p in off.plan.offloaded_params) == 4 * 7 * 3
    assert all(torch.equal(a, b) for a, b in zip(step_logits(model), step_logits(reference), strict=True))
    off.restore()
    assert len(_wrappers(model)) == 4 * 7


@pytest.mark.parametrize("backend", ["none", *sorted(BACKENDS)])
def test_the_live_check_finds_every_inner_tensor_where_the_plan_put_it(backend: str) -> None:
    """Resident ones too (the none backend unpacks as the others do: the plan names the
    inner tensors), and nothing is missing."""
    reference = _quantised("int8-weight-only")
    model = copy.deepcopy(reference)
    off = offload_model(model, OffloadConfig(backend="none") if backend == "none" else BACKENDS[backend])
    places = off.check().params
    inner = [p for p in places if ".parametrizations.weight.original" in p.name]
    assert len(inner) == 4 * 7 * 3
    assert all(p.actual == p.expected and p.actual is not Location.MISSING for p in places)
    state, ref_state = model.state_dict(), reference.state_dict()
    assert sorted(state) == sorted(ref_state)
    assert all(torch.equal(a, b) for a, b in zip(step_logits(model), step_logits(reference), strict=True))
    off.restore()
    assert len(_wrappers(model)) == 4 * 7


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


@pytest.mark.filterwarnings("ignore:`torch.jit.script")  # inductor's import reaches it (see test_compile_ordering)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_whole_graph_over_deferred_copies_equals_the_resident_quantised_model(compiler: str) -> None:
    """torch.compile traces the rebuilt wrapper (fullgraph: no break), and each layer's
    int8 math still reads its slot after the prefetch op's wait: a `FakeRuntime` that
    defers every copy until it is waited for makes a read that overtakes its wait see the
    slot's previous owner."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Projection() for _ in range(6)]).requires_grad_(False)
    quantize_(model, Int8WeightOnlyConfig())
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), FakeRuntime(defer=True))
    off.wrap_modules(layer_list(model))
    off.post_init()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=compiler, fullgraph=True)
        with torch.no_grad():
            for seed in range(3):
                x = torch.randn(2, 64, generator=torch.Generator().manual_seed(seed))
                assert torch.equal(compiled(x), reference(x))
    finally:
        off.restore()
        torch._dynamo.reset()


class _Tied(nn.Module):
    """Layers and a head that shares the first layer's quantised weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Projection() for _ in range(3)])
        self.head = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def test_a_quantised_weight_tied_to_a_module_outside_the_layers_is_refused_before_anything_moves() -> None:
    """As a plain weight tied there is: offloading it would leave the outside module
    reading a slot (told by the inner tensors' storage, the wrapper having none)."""
    torch.manual_seed(0)
    model = _Tied().requires_grad_(False)
    quantize_(model, Int8WeightOnlyConfig())
    first: Any = model.layers[0]
    model.head.weight = first.proj.weight
    before = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    with pytest.raises(PlanError, match=r"layer 0 parameter 'proj\.parametrizations\.weight\.original0' shares its "
                                        r"storage with a tensor outside the layers"):
        offload_model(model, BACKENDS["prefetch"])
    assert [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)] == before


def test_a_quantised_weight_outside_the_layers_off_the_device_is_refused_before_anything_moves() -> None:
    """On a played CUDA device, a quantised head still on the host: moving a tensor
    subclass is its own conversion, not made yet; said by name, nothing moved."""
    model = _quantised("int8-weight-only")
    quantize_(model.lm_head, Int8WeightOnlyConfig(), filter_fn=None)
    assert is_wrapper(model.lm_head.weight)
    before = [(n, id(p), p.device) for n, p in model.named_parameters()]
    runtime = FakeRuntime(device="cuda:0")
    with pytest.raises(PlanError, match=r"Linear\.weight is a quantised weight \(Int8Tensor\) outside the layer "
                                        r"stacks, on cpu: offload does not move such weights to cuda:0 yet"):
        offload_model(model, BACKENDS["prefetch"], env=EnvSnapshot(flags=EnvFlags(), platform=CUDA_LIKE),
                      runtime=runtime)
    assert [(n, id(p), p.device) for n, p in model.named_parameters()] == before
    assert all("forward" not in module.__dict__ for module in model.modules())
