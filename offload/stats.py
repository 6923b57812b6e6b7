"""What an offloader reports about its work: `OffloadStats`."""

from __future__ import annotations

import attrs

__all__ = ["OffloadStats"]


@attrs.frozen(kw_only=True)
class OffloadStats:
    """Counters of one offloader since `wrap_modules`.

    Attributes:
        params_offloaded: parameters currently held in host memory.
        params_dropped: planned parameters that post-processing deleted.
        host_bytes: host memory held for weights, in bytes.
        device_buffer_bytes: device memory held in static buffers, in bytes.
        copies_issued: host-to-device copies issued (one per parameter and prefetch).
        bytes_copied: bytes those copies moved.
        wait_seconds: time the compute stream waited for copies, in seconds; None when
            the runtime cannot measure it.
        pin_fallbacks: host copies the plan pins that stayed pageable because pinning
            them failed (the model works; such a model cannot be captured in a CUDA graph).
        realignments: prefetch: times the schedule was put right because offloaded layers
            ran out of order, were skipped or run twice, or a forward stopped part way (the
            weights stay correct; the layers until the next step copy on demand).
    """

    params_offloaded: int = 0
    params_dropped: int = 0
    host_bytes: int = 0
    device_buffer_bytes: int = 0
    copies_issued: int = 0
    bytes_copied: int = 0
    wait_seconds: float | None = None
    pin_fallbacks: int = 0
    realignments: int = 0
