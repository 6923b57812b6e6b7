"""The expert caches and their replay for people: a few lines per plan (`render_caches`)
and a line or two per replay (`render_replay`)."""

from __future__ import annotations

from offload.pure.experts.replay import Replay
from offload.pure.experts.values import CachePolicy, ExpertCachePlan
from offload.pure.units import format_bytes

__all__ = ["layer_runs", "render_caches", "render_replay"]


def layer_runs(layers: tuple[int, ...]) -> str:
    """``"0-3, 5, 7-9"``: the sorted distinct layers as runs."""
    ordered = sorted(set(layers))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(runs)


def _held_text(held: tuple[int, ...]) -> str:
    return f"held experts {layer_runs(held)}" if held else "none held"


def render_caches(plans: tuple[ExpertCachePlan, ...]) -> str:
    """A line per shape of cache (the layers that share module, E, B, C, held experts and
    policy: ``layers 0-47``), then the total; ``"expert cache: none"`` without plans.

    Example::

        expert cache: 48 layers, 6.00 GiB on the device
          layers 0-47  mlp.experts: E 64 x 16.0 MiB, C 8 slots = 128.0 MiB each, none held, policy lfu
    """
    if not plans:
        return "expert cache: none"
    shapes: dict[tuple[str, int, int, int, tuple[int, ...], CachePolicy], list[int]] = {}
    for plan in plans:
        g = plan.group
        shapes.setdefault((g.module, g.num_experts, g.expert_bytes, plan.slots, plan.held, plan.policy),
                          []).append(g.layer)
    total = sum(plan.device_bytes for plan in plans)
    count = len({plan.layer for plan in plans})
    lines = [f"expert cache: {count} layer{'s' if count != 1 else ''}, {format_bytes(total)} on the device"]
    labels = []
    for layers in shapes.values():
        word = "layers" if len(set(layers)) > 1 else "layer"
        labels.append(f"{word} {layer_runs(tuple(layers))}")
    width = max(len(label) for label in labels)
    for label, (module, e, b, c, held, policy) in zip(labels, shapes, strict=True):
        lines.append(f"  {label:<{width}}  {module}: E {e} x {format_bytes(b)}, C {c} slot{'s' if c != 1 else ''} "
                     f"= {format_bytes(c * b)} each, {_held_text(held)}, policy {policy.value}")
    return "\n".join(lines)


def render_replay(replay: Replay, belady: Replay | None = None) -> str:
    """One line: the hit rate (and Belady's optimum beside it, where given), the expert
    bytes copied from the host per step and over the trace.

    Example::

        expert cache replay: 46.4% hits (Belady's optimum 54.9%) of 16000 routed, 2000 steps,
        1.4 MiB per step from the host (2.74 GiB)

    (one line; broken here to fit).
    """
    beside = f" (Belady's optimum {belady.hit_rate:.1%})" if belady is not None else ""
    steps = len(replay.step_bytes)
    return (f"expert cache replay: {replay.hit_rate:.1%} hits{beside} of {replay.routed} routed, {steps} "
            f"step{'s' if steps != 1 else ''}, {format_bytes(round(replay.mean_step_bytes))} per step from the "
            f"host ({format_bytes(replay.total_bytes)})")
