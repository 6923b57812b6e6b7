"""Fit results and step estimates as text for people: tables, totals and the arithmetic."""

from __future__ import annotations

from offload.pure.config import OffloadConfig
from offload.pure.fit.candidates import describe
from offload.pure.fit.estimate import LayerEstimate, StepEstimate
from offload.pure.fit.search import FitCandidate, FitResult
from offload.pure.plan.render import render_plan, render_table
from offload.pure.units import format_bytes

__all__ = ["describe_config", "format_seconds", "render_estimate", "render_fit"]


def format_seconds(seconds: float) -> str:
    """``"1.234 s"`` from 1 s, ``"12.345 ms"`` from 1 ms, ``"56.7 us"`` below, ``"0 s"`` for 0."""
    if seconds == 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 'es' if noun.endswith('s') else 's'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def describe_config(config: OffloadConfig) -> str:
    """A one-line description of a configuration, with its filter."""
    return describe(config)


def _layer_cells(layer: LayerEstimate, experts: bool) -> list[str]:
    return [_ms(layer.compute_seconds), _ms(layer.copy_seconds), _ms(layer.stall_seconds),
            _ms(layer.uva_read_seconds), _ms(layer.on_demand_seconds),
            *([_ms(layer.expert_seconds)] if experts else []), _ms(layer.seconds),
            format_bytes(layer.copy_bytes + layer.uva_bytes + layer.on_demand_bytes + layer.expert_bytes)]


def _expert_lines(step: StepEstimate) -> list[str]:
    """What the routing trace makes the expert caches copy; without one, their worst case
    (nothing where they copy nothing at their calls)."""
    rate = step.expert_hit_rate
    if rate is None:
        if not step.expert_bytes:
            return []
        return [f"experts          = {format_bytes(step.expert_bytes)} ({step.expert_bytes} bytes) of misses per step "
                f"at most, the worst case without a routing trace (as many experts missed at each call as its "
                f"tokens can route); the layers wait {format_seconds(step.expert_seconds)} for them"]
    belady = f", Belady {step.belady_hit_rate * 100:.1f}%" if step.belady_hit_rate is not None else ""
    return [f"experts          = {format_bytes(step.expert_bytes)} ({step.expert_bytes} bytes) of misses per step, "
            f"hit rate {rate * 100:.1f}%{belady}, over {_count(step.routing_steps, 'step')} of the routing trace; "
            f"the layers wait {format_seconds(step.expert_seconds)} for them"]


def _loaded_once_lines(step: StepEstimate) -> list[str]:
    """What the layers alone in their slots load once (nothing when there are none)."""
    once = step.loaded_once_bytes
    if not once:
        return []
    layers = sum(1 for layer in step.layers if layer.loaded_once_bytes)
    return [f"loaded once      = {format_bytes(once)} ({once} bytes), {layers} layer{'' if layers == 1 else 's'} "
            f"alone in {'its slot' if layers == 1 else 'their slots'}: copied before the first step, not per step"]


def render_estimate(step: StepEstimate) -> str:
    """The estimate: rates, one row per run of identical layers (times in ms, each
    layer), totals, and the arithmetic of the limit and of the predicted step."""
    runs: list[tuple[int, int, list[str]]] = []
    experts = bool(step.routing_steps) or step.expert_seconds > 0
    for layer in step.layers:
        cells = _layer_cells(layer, experts)
        if runs and runs[-1][2] == cells and runs[-1][1] == layer.layer - 1:
            runs[-1] = (runs[-1][0], layer.layer, cells)
        else:
            runs.append((layer.layer, layer.layer, cells))
    rows = [[str(a) if a == b else f"{a}-{b}", *cells] for a, b, cells in runs]
    rows.append(["total", _ms(step.compute_seconds), _ms(step.copy_seconds), _ms(step.stall_seconds),
                 _ms(step.uva_read_seconds), _ms(step.on_demand_seconds),
                 *([_ms(step.expert_seconds)] if experts else []), _ms(step.step_seconds),
                 format_bytes(step.offloaded_bytes_per_step)])
    tokens = f"{_count(step.tokens_per_step, 'token')} per step" if not step.stack_tokens else \
        f"tokens per step by stack {', '.join(str(t) for t in step.stack_tokens)}"
    source = "compute from FLOPs and weight reads" if step.compute_from == "flops" else \
        "compute scaled from a measured resident step time"
    lines = [
        f"estimate on {step.profile}, {tokens} ({source})",
        f"rates: copies {_rate(step.copy_bytes_per_s)}, pinned {_rate(step.pinned_bytes_per_s)}, "
        f"zero-copy reads {_rate(step.uva_bytes_per_s)}",
        "",
        render_table(["layers", "compute ms", "copy ms", "stall ms", "uva ms", "on-demand ms",
                      *(["experts ms"] if experts else []), "total ms", "moved"], rows),
        "",
        f"resident compute = {format_seconds(step.compute_seconds)} (sum of the compute column)",
        f"link             = {format_bytes(step.offloaded_bytes_per_step)} ({step.offloaded_bytes_per_step} bytes)"
        f" / {_rate(step.pinned_bytes_per_s)} = {format_seconds(step.link_seconds)}",
        *_loaded_once_lines(step),
        *_expert_lines(step),
        *([f"disk             = {format_seconds(step.disk_read_seconds)} of reads per step (the disk tier; a late "
           "read is in the stalls): no step is faster"] if step.disk_read_seconds else []),
        f"limit            = max({format_seconds(step.compute_seconds)}, {format_seconds(step.link_seconds)}"
        + (f", {format_seconds(step.disk_read_seconds)}" if step.disk_read_seconds else "")
        + f") = {format_seconds(step.limit_seconds)}"
        + (" (compute, link, disk)" if step.disk_read_seconds else " (compute, link)"),
        f"predicted step   = compute {format_seconds(step.compute_seconds)} + stalls "
        f"{format_seconds(step.stall_seconds)} + uva {format_seconds(step.uva_read_seconds)} + on demand "
        f"{format_seconds(step.on_demand_seconds)}"
        + (f" + experts {format_seconds(step.expert_seconds)}" if experts else "")
        + f" = {format_seconds(step.step_seconds)}, "
        f"{step.ratio_to_limit:.3f} x the limit",
        f"(steady state after {_count(step.passes, 'simulated pass')}, period {step.period})",
    ]
    return "\n".join(lines)


def _candidate_row(rank: int, c: FitCandidate, best: FitCandidate) -> list[str]:
    slower = (c.step_seconds / best.step_seconds - 1) * 100 if best.step_seconds > 0 else 0.0
    return [str(rank), describe_config(c.config), _ms(c.step_seconds), f"+{slower:.2f}%" if rank > 1 else "best",
            format_bytes(c.device_bytes), format_bytes(c.host_bytes)]


def render_fit(result: FitResult, *, plan: bool = True, estimate: bool = True) -> str:
    """The fit: budget, chosen configuration with its device-byte sum, runners-up, and
    (optionally) the chosen plan and its estimate."""
    c = result.chosen
    spare = result.budget_bytes - c.device_bytes
    lines = [
        f"fit for a device budget of {format_bytes(result.budget_bytes)} ({result.budget_bytes} bytes) "
        f"on {result.profile.name} ({result.profile.device_name}), "
        f"{_count(result.workload.tokens_per_step, 'token')} per step",
        f"chosen:  {describe_config(c.config)}",
        f"device:  resident {format_bytes(c.resident_bytes)} + buffers {format_bytes(c.buffer_bytes)} + "
        f"on-demand {format_bytes(c.transient_bytes)} + outside layers {format_bytes(c.outside_bytes)} + "
        f"reserve {format_bytes(c.reserve_bytes)} = "
        f"{format_bytes(c.device_bytes)} ({c.device_bytes} bytes), {format_bytes(spare)} to spare",
        f"host:    {format_bytes(c.host_bytes)}",
        f"step:    {format_seconds(c.step_seconds)} predicted, limit {format_seconds(c.limit_seconds)}",
        f"search:  {_count(result.considered, 'candidate')} considered, {result.simulated} simulated",
    ]
    if result.runners_up:
        lines += ["", render_table(["rank", "configuration", "step ms", "vs chosen", "device", "host"],
                                   [_candidate_row(i, x, c) for i, x in
                                    enumerate((c, *result.runners_up), start=1)])]
    if plan:
        lines += ["", render_plan(result.plan)]
    if estimate:
        lines += ["", render_estimate(result.estimate)]
    return "\n".join(lines)
