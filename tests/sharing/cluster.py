"""Start N rank processes on this machine and collect what each saw, with a deadline.

Processes come from a ``forkserver`` that has imported torch and offload once: a fresh
interpreter importing torch takes over 4 s here (22 s to start 4 ranks with ``spawn`` on
2 cores), a fork of the server a few milliseconds. Each child is still a clean process
(forked from the single-threaded server, not from pytest). A rank that has not exited by
the deadline is killed and the test fails saying so: a bug can never hang the suite.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

import attrs

from tests.sharing.workers import rank_main

__all__ = ["RankResult", "run_ranks"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "offload.sharing", "tests.sharing.workers"])


@attrs.frozen
class RankResult:
    """One rank: its exit code and what it wrote (None when it died first)."""

    rank: int
    exitcode: int | None
    written: dict[str, Any] | None

    @property
    def result(self) -> dict[str, Any]:
        """Its scenario's result.

        Raises:
            AssertionError: it wrote none, or wrote an error (with its traceback).
        """
        assert self.written is not None, f"rank {self.rank} wrote nothing (exit code {self.exitcode})"
        assert self.written["ok"], f"rank {self.rank} failed: {self.written['traceback']}"
        value: dict[str, Any] = self.written["result"]
        return value


def run_ranks(world: int, scenario: str, folder: Path, *, deadline_s: float = 60.0,
              **kwargs: Any) -> list[RankResult]:
    """Run `scenario` on `world` ranks (torch.distributed over gloo, a FileStore in
    `folder`); every rank's result, in rank order.

    Raises:
        AssertionError: a rank was still running at the deadline (all are killed).
    """
    out = folder / "out"
    out.mkdir(parents=True, exist_ok=True)
    store = str(folder / "store")
    procs = [_CONTEXT.Process(target=rank_main, args=(rank, world, store, str(out), scenario, kwargs), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} of {scenario} were still running after {deadline_s} s"
    results = []
    for rank, p in enumerate(procs):
        path = out / f"result-{rank}.json"
        written = json.loads(path.read_text()) if path.exists() else None
        results.append(RankResult(rank=rank, exitcode=p.exitcode, written=written))
    return results
