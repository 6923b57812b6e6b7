"""``offload plan DIR --routing-trace FILE``: the estimate of a saved MoE checkpoint over
the routing trace recorded from its model, a user's whole path (record, write the JSON,
plan); a trace of another model, or one the plan cannot use, is an exit 2 naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.cli import main
from offload.executors.experts import record_routing
from offload.pure.experts.profile import trace_to_json
from offload.pure.experts.replay import belady, replay
from offload.pure.plan.plan import OffloadPlan
from tests.hf.checkpoints import save
from tests.hf.moe_models import build_moe, decode_logits

FLAGS = ("--backend", "prefetch", "--group-size", "1", "--prefetch-step", "2", "--expert-slots", "2", "--profile", "h100-pcie5")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _checkpoint_and_trace(tmp_path: Path, layers: int = 2) -> tuple[Path, Path, object]:
    model = build_moe("qwen3_moe", layers)
    with record_routing(model.model.layers) as record:
        decode_logits(model, 1, steps=4)
    trace = record.trace()
    directory = save(model, tmp_path / f"model{layers}", sharded=False)
    path = tmp_path / f"trace{layers}.json"
    path.write_text(trace_to_json(trace))
    return directory, path, trace


def test_the_estimate_counts_the_caches_over_the_recorded_trace(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    directory, path, trace = _checkpoint_and_trace(tmp_path)
    code, out, err = _run(capsys, "plan", str(directory), *FLAGS, "--json")
    assert code == 0, err
    plan = OffloadPlan.from_json(out)
    assert len(plan.experts) == 2 and all(c.slots == 2 for c in plan.experts)
    code, out, err = _run(capsys, "plan", str(directory), *FLAGS, "--routing-trace", str(path))
    assert code == 0, err
    policy = replay(plan.experts, trace)  # type: ignore[arg-type]
    optimum = belady(plan.experts, trace)  # type: ignore[arg-type]
    assert f"hit rate {policy.hit_rate * 100:.1f}%, Belady {optimum.hit_rate * 100:.1f}%, over 5 steps" in out
    assert "experts ms" in out
    code, worst, err = _run(capsys, "plan", str(directory), *FLAGS)
    assert code == 0 and "of the routing trace" not in worst and "hit rate" not in worst
    assert "the worst case without a routing trace" in worst  # the model's top-k bounds it


def test_a_trace_of_another_model_or_without_a_profile_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, _, _ = _checkpoint_and_trace(tmp_path)
    _, deeper, _ = _checkpoint_and_trace(tmp_path, layers=3)
    code, _, err = _run(capsys, "plan", str(directory), *FLAGS, "--routing-trace", str(deeper))
    assert code == 2 and "2:mlp.experts is not this model's" in err
    code, _, err = _run(capsys, "plan", str(directory), "--routing-trace", str(deeper))
    assert code == 2 and "--routing-trace is for the estimate; give --profile" in err
    code, _, err = _run(capsys, "plan", str(directory), "--fit-gib", "1", "--profile", "h100-pcie5",
                        "--host-gib", "1", "--routing-trace", str(deeper))
    assert code == 2 and "2:mlp.experts is not this model's" in err  # with a host budget too
    missing = tmp_path / "nothing.json"
    code, _, err = _run(capsys, "plan", str(directory), *FLAGS, "--routing-trace", str(missing))
    assert code == 2 and "--routing-trace: cannot read" in err and "No such file" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "offload-routing-trace/1", "trace": {"groups": [], "steps": [[[0]]]}}))
    code, _, err = _run(capsys, "plan", str(directory), *FLAGS, "--routing-trace", str(bad))
    assert code == 2 and "--routing-trace" in err and "groups" in err


def test_fit_with_a_host_budget_searches_over_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fit-gib`` and ``--host-gib`` with ``--routing-trace``: the search over both
    budgets costs the caches over the trace (UVA off, so that prefetch is chosen)."""
    monkeypatch.setenv("OFFLOAD_DISABLE_UVA", "1")
    directory, path, trace = _checkpoint_and_trace(tmp_path)
    argv = ("plan", str(directory), "--fit-gib", "0.0005", "--profile", "h100-pcie5", "--host-gib", "0.0006")
    code, out, err = _run(capsys, *argv, "--routing-trace", str(path), "--json")
    assert code == 0, err
    over = json.loads(out)["fit"]
    assert over["chosen"]["config"]["backend"] == "prefetch" and over["plan"]["experts"]
    assert over["estimate"]["routing_steps"] == len(trace.steps)  # type: ignore[attr-defined]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    assert json.loads(out)["fit"]["estimate"]["routing_steps"] == 0


def test_offload_load_of_a_moe_checkpoint_sizes_and_reports_its_expert_caches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, _, _ = _checkpoint_and_trace(tmp_path)
    code, out, err = _run(capsys, "load", str(directory), "--backend", "prefetch", "--group-size", "1",
                          "--prefetch-step", "2", "--expert-slots", "3")
    assert code == 0, err
    assert "expert caches in 2 layers, 3 slots each" in out
    stats = next(line for line in out.splitlines() if line.startswith("stats:"))
    hits, misses = (int(stats.split(" hits and ")[0].rsplit(" ", 1)[1]),
                    int(stats.split(" hits and ")[1].split(" misses")[0]))
    assert misses > 0 and hits + misses > 0
    code, _, err = _run(capsys, "load", str(directory), "--backend", "prefetch", "--group-size", "1",
                        "--expert-slots", "65")
    assert code == 2 and "expert_slots (C) 65 is more than the 64 experts of layer 0" in err


def test_a_fit_over_the_recorded_trace_gives_the_estimate_over_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    directory, path, trace = _checkpoint_and_trace(tmp_path)
    budget = "0.0005"  # GiB: below the model's layers, where prefetch with caches wins
    code, out, err = _run(capsys, "plan", str(directory), "--fit-gib", budget, "--profile", "h100-pcie5",
                          "--json", "--routing-trace", str(path))
    assert code == 0, err
    chosen = json.loads(out)
    code, out, err = _run(capsys, "plan", str(directory), "--fit-gib", budget, "--profile", "h100-pcie5",
                          "--routing-trace", str(path))
    assert code == 0, err
    assert chosen["plan"]["experts"] and chosen["chosen"]["config"]["expert_cache"] is True
    assert "over 5 steps of the routing trace" in out and "experts ms" in out
