"""`capture_forward`: capture one forward of an offloaded model in a CUDA graph, following
the offloader's protocol (warm up, `sync_prev_onload` before the capture,
`join_after_forward` inside it after the forward).

`captured` is that protocol without CUDA (the capture is any context manager), so that it
is tested on the CPU with a runtime that plays a capture.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from offload.errors import ExecutionError
from offload.logs import logger
from offload.protocols import Offloader

__all__ = ["capture_forward", "captured"]

log = logger("offload.compile")

T = TypeVar("T")


def captured(run: Callable[[], T], offloader: Offloader | None, capture: AbstractContextManager[object]) -> T:
    """Run `run` inside `capture` as the offloader needs it.

    Before: `sync_prev_onload` (every earlier copy has landed). Inside, after `run`:
    `join_after_forward`. If anything fails in between, or ending the capture fails, the
    capture is void: nothing it recorded ever runs, while the offloader counted the copies
    issued in it as in flight. So `sync_prev_onload` runs again once the capture has ended
    (nothing is in flight any more, and nothing issued inside the capture is still
    pending), and the next eager forward realigns the offloader's schedule where the
    aborted forward left it (a forward that stopped part way starts a new step).

    Args:
        run: the forward to capture.
        offloader: the model's offloader, or None for a model without one.
        capture: the capture, e.g. ``torch.cuda.graph(graph)``.

    Returns:
        What `run` returned.

    Raises:
        Whatever `run`, the offloader or the capture raised (the first failure; a failure of
        the recovering `sync_prev_onload` is logged, not raised over it).
    """
    if offloader is not None:
        offloader.sync_prev_onload()
    try:
        with capture:
            output = run()
            if offloader is not None:
                offloader.join_after_forward()
    except BaseException:
        if offloader is not None:
            try:
                offloader.sync_prev_onload()
            except Exception:  # the capture's own failure is the one to report
                log.warning("after an aborted CUDA graph capture, sync_prev_onload failed too", exc_info=True)
        raise
    return output


def capture_forward(
    model: Callable[[torch.Tensor], Any], static_input: torch.Tensor, offloader: Offloader | None = None, *,
    warmup: int = 2,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``model(static_input)`` in a CUDA graph.

    Warms up on a side stream (`warmup` forwards, as PyTorch asks before capture), waits
    for the offloader's earlier copies, captures one forward and joins the copies issued
    inside it (see `captured`, which also recovers from a capture that fails). Replay with
    ``graph.replay()`` after writing new values into `static_input`.

    Args:
        model: the model (or any callable of one tensor).
        static_input: the input tensor the graph reads on every replay.
        offloader: the model's offloader, or None for a model without one.
        warmup: forwards run before the capture.

    Returns:
        The graph and the output of the captured forward (rewritten by each replay).

    Raises:
        ExecutionError: the offloader refuses the capture (e.g. weights in pageable memory;
            expert caches, whose copies depend on the routing, Note [expert cache]); the
            model stays usable eagerly.
    """
    experts = offloader.plan.experts if offloader is not None else ()
    if experts:
        first = experts[0].group
        raise ExecutionError(f"layer {first.layer} {first.module} (and {len(experts) - 1} more experts modules) copy "
                             "their experts as the routing asks, which a CUDA graph cannot capture: offload with "
                             "OffloadConfig(expert_cache=False) to capture the model", name=first.module,
                             value=first.layer)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            model(static_input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    output = captured(lambda: model(static_input), offloader, torch.cuda.graph(graph))
    return graph, output
