"""`capture_forward`: capture one forward of an offloaded model in a CUDA graph, following
the offloader's protocol (warm up, `sync_prev_onload` before the capture,
`join_after_forward` inside it after the forward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from offload.protocols import Offloader

__all__ = ["capture_forward"]


def capture_forward(
    model: Callable[[torch.Tensor], Any], static_input: torch.Tensor, offloader: Offloader | None = None, *,
    warmup: int = 2,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``model(static_input)`` in a CUDA graph.

    Warms up on a side stream (`warmup` forwards, as PyTorch asks before capture), waits
    for the offloader's earlier copies, captures one forward and joins the copies issued
    inside it. Replay with ``graph.replay()`` after writing new values into `static_input`.

    Args:
        model: the model (or any callable of one tensor).
        static_input: the input tensor the graph reads on every replay.
        offloader: the model's offloader, or None for a model without one.
        warmup: forwards run before the capture.

    Returns:
        The graph and the output of the captured forward (rewritten by each replay).

    Raises:
        ExecutionError: the offloader refuses the capture (e.g. weights in pageable memory).
    """
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            model(static_input)
    torch.cuda.current_stream().wait_stream(side)
    if offloader is not None:
        offloader.sync_prev_onload()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = model(static_input)
        if offloader is not None:
            offloader.join_after_forward()
    return graph, output
