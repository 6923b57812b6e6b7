"""Plans as text for people: a header of decisions, a table, totals in GiB, warnings."""

from __future__ import annotations

from collections.abc import Sequence

from offload.pure.decide.admission import HostFit
from offload.pure.decide.moves import Move, move_text
from offload.pure.experts.render import render_caches
from offload.pure.plan.blocks import copies_per_step, layer_copies
from offload.pure.plan.plan import Backend, OffloadPlan, ParamPlan, Placement
from offload.pure.units import format_bytes

__all__ = ["render_plan", "render_table"]


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to width; numbers (cells starting with a digit) right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for i, cell in enumerate(cells):
            numeric = cell[:1].isdigit()
            parts.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _placement_text(p: ParamPlan) -> str:
    if p.placement is Placement.PREFETCH:
        return f"prefetch (slot {p.slot})"
    return str(p.placement.value).replace("_", "-")


def _layer_rows(plan: OffloadPlan) -> list[list[str]]:
    by_layer: dict[int, list[ParamPlan]] = {}
    for p in plan.params:
        by_layer.setdefault(p.layer, []).append(p)
    # Consecutive layers with identical rows collapse into one ("0-2"), slots listed
    # together ("prefetch (slots 0, 1)"), so a plan for a deep model stays readable.
    runs: list[tuple[int, int, tuple[str, ...], set[int]]] = []
    for layer, params in by_layer.items():
        gone = [p for p in params if p.offloaded and p.tied_to is None]
        kinds = sorted({p.placement.value for p in params if p.offloaded})
        cells = (
            f"{sum(p.offloaded for p in params)}/{len(params)}",
            format_bytes(sum(p.nbytes for p in gone)),
            *kinds,
        )
        slots = {p.slot for p in params if p.slot is not None}
        if runs and runs[-1][2] == cells and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer, cells, runs[-1][3] | slots)
        else:
            runs.append((layer, layer, cells, slots))
    rows = []
    for a, b, cells, slots in runs:
        placement = ", ".join(kind.replace("_", "-") for kind in cells[2:]) or "resident"
        if slots:
            placement += f" (slot{'s' if len(slots) > 1 else ''} {', '.join(map(str, sorted(slots)))})"
        rows.append([str(a) if a == b else f"{a}-{b}", cells[0], cells[1], placement])
    return rows


def _param_rows(plan: OffloadPlan) -> list[list[str]]:
    return [
        [
            str(p.layer),
            p.name,
            "x".join(map(str, p.shape)) or "scalar",
            p.dtype,
            format_bytes(p.nbytes),
            _placement_text(p) + (f" (tied to {p.tied_to[0]}:{p.tied_to[1]})" if p.tied_to else ""),
        ]
        for p in plan.params
    ]


_ENFORCED = {
    "refuse": "wrap_modules refuses it (host_check='refuse')",
    "warn": "runs anyway with a warning (host_check='warn')",
    "off": "not enforced (host_check='off')",
}


def _admission_lines(plan: OffloadPlan) -> list[str]:
    """The host admission verdict, then one line per limit compared."""
    admission = plan.host_admission
    mode = plan.config.host_check
    if admission.verdict is HostFit.DOES_NOT_FIT:
        head = f"does not fit, {_ENFORCED[mode]}: {admission.message}"
    else:
        head = admission.message + (" (host_check='off')" if mode == "off" else "")
    lines = [f"host mem: {head}"]
    for check in admission.checks:
        allowed = "unknown" if check.allowed_bytes is None else format_bytes(check.allowed_bytes)
        what = "pinned host memory" if check.pinned else "new host memory"
        mark = {True: "ok", False: "over", None: "?"}[check.fits]
        tag = ""
        if check.limit is admission.binding:
            tag = " (binds)" if admission.verdict is HostFit.DOES_NOT_FIT else " (tightest)"
        lines.append(f"  {mark:<4} {check.source}: {format_bytes(check.needed_bytes)} {what} needed, "
                     f"{allowed} allowed{tag}")
    return lines


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _loaded_once(plan: OffloadPlan, copies: Sequence[int]) -> str:
    """`` (+N loaded once: layer L has a slot of its own)`` for the layers alone in their
    slots, which are copied once at the start and not per step; "" when there are none."""
    kept = sorted(plan.schedule.kept_positions)
    if not kept:
        return ""
    once = sum(copies[i] for i in kept)
    if len(kept) == 1:
        who = f"layer {plan.offloaded_layers[kept[0]]} has a slot of its own"
    elif len(kept) <= 4:
        who = f"layers {', '.join(str(plan.offloaded_layers[i]) for i in kept)} have slots of their own"
    else:
        who = f"{len(kept)} layers have slots of their own"
    return f" (+{once} loaded once: {who})"


def render_plan(plan: OffloadPlan, *, per_param: bool = False) -> str:
    """A readable description of the plan.

    Args:
        plan: the plan.
        per_param: one row per parameter instead of one per layer.

    Returns:
        Multi-line text: decisions with reasons, the table, buffers, totals, warnings.
    """
    c = plan.config
    lines = [
        f"backend:  {plan.backend.value} ({plan.backend_reason.value.replace('_', ' ')})",
        f"pinning:  {f'on ({plan.pin.method_text})' if plan.pin.pin else 'off'}: {plan.pin.explanation}",
        f"uva:      {'on' if plan.uva.enabled else 'off'}: {plan.uva.explanation}",
        f"host copies: {plan.host_numa.text}",
    ]
    if plan.backend is Backend.PREFETCH:
        lines.append(
            f"prefetch: group_size {c.group_size}, num_in_group {c.num_in_group}, "
            f"prefetch_step {c.prefetch_step}; {len(plan.offloaded_layers)} layers offloaded, "
            f"{plan.schedule.num_slots} slot{'' if plan.schedule.num_slots == 1 else 's'} per buffer key"
        )
        if plan.schedule.cycles:
            ranges = plan.schedule.cycle_ranges
            lines.append("cycles:   " + "; ".join(
                f"layers {plan.offloaded_layers[first]}-{plan.offloaded_layers[stop - 1]} "
                f"({stop - first} offloaded, {_count(len({plan.schedule.slots[i] for i in range(first, stop)}), 'slot')})"
                for first, stop in ranges) + ": one per stack, each prefetched on its own")
        copies = layer_copies(plan)
        if copies:
            whole = sum(1 for n in copies if n == 1)
            lines.append(f"copies:   {sum(copies_per_step(plan))} per step{_loaded_once(plan, copies)}; {whole} of "
                         f"{len(copies)} offloaded layers are one copy each "
                         f"(layer_blocks {c.layer_blocks}, weights where they are now)")
        if plan.experts:
            lines.append("experts:  copied expert by expert as the routing asks, not with their layers' copies; "
                         + render_caches(plan.experts).replace("\n", "\n          "))
    if plan.backend is Backend.UVA:
        lines.append(f"uva budget: {format_bytes(c.uva_max_bytes)}")
    if c.param_filter:
        lines.append(f"filter:   {', '.join(c.param_filter)}")
    if c.keep_host_params:
        lines.append("host:     parameters in host memory stay there (keep_host_params)")
    moves = [(m, n, b) for m, n, b in plan.planned_moves() if m is not Move.KEEP]
    if moves:
        lines.append("moves:    " + "; ".join(
            f"{n} {'parameter' if n == 1 else 'parameters'} {move_text(m)} ({format_bytes(b)})" for m, n, b in moves
        ))
    lines.extend(_admission_lines(plan))
    lines.append(f"snapshot: {plan.env_fingerprint}")
    lines.append("")
    if per_param:
        lines.append(render_table(["layer", "parameter", "shape", "dtype", "bytes", "placement"], _param_rows(plan)))
    else:
        lines.append(render_table(["layers", "offloaded", "bytes offloaded (each)", "placement"], _layer_rows(plan)))
    if plan.buffers:
        lines.append("")
        lines.append(render_table(
            ["buffer key", "shape", "dtype", "slots", "bytes"],
            [
                [b.name, "x".join(map(str, b.shape)) or "scalar", b.dtype,
                 f"{len(b.slots)}, one buffer (expert rows)" if b.shared else str(len(b.slots)),
                 format_bytes(b.nbytes)]
                for b in plan.buffers
            ],
        ))
    lines.append("")
    lines.append(render_table(
        ["total", "bytes", "GiB"],
        [
            [name, str(value), f"{value / (1 << 30):.2f}"]
            for name, value in (
                ("offloaded", plan.offloaded_bytes),
                ("device freed", plan.device_bytes_freed),
                ("device buffers", plan.device_bytes_buffers),
                ("device saved (net)", plan.device_bytes_saved),
                ("device resident", plan.device_bytes_resident),
                ("host", plan.host_bytes),
            )
        ],
    ))
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines.extend(f"  [{w.code.value}] {w.message}" for w in plan.warnings)
    return "\n".join(lines)
