"""`UVAOffloader`: weights in host memory, read in place by the device, or copied to it
for each call of their layer.

It follows the plan and decides nothing. A parameter the plan places UVA points at a
zero-copy device view of its host copy (`Runtime.device_view`): kernels read host memory
over the link, so there are no buffers, no schedule and nothing in flight, and a forward
is plain kernels that a CUDA graph can capture. A parameter placed ON_DEMAND (the plan's
`UvaDecision` is off: the user's switch, no host mapping, pinning off, no CUDA) points at
its host copy, and its layer's forward runs through `torch.func.functional_call` with a
device copy of each such storage, made on the compute stream when the call starts.

Host copies: one per storage (`HostStore`), pinned exactly when ``plan.pin.pin`` says;
tied parameters, within a layer or across layers, share it and the one view of it, so
ties stay ties. If pinning a UVA parameter's copy fails, that copy stays pageable
(counted in `stats().pin_fallbacks`) and, since a pageable copy cannot be viewed, the
parameter is copied on demand instead: the model keeps working.

Lifecycle, as for the prefetch backend: `wrap_modules`, then `post_init` once the weights
are final, then forwards, then `restore`. UVA layers carry no hook and already work after
`wrap_modules`; an on-demand layer that runs before `post_init` raises `ExecutionError`,
because post-processing may have replaced its weights and only `post_init` re-reads them.

The backend is built in one line of parts, each using only what lies below it: its fields
and counters (`state.py`), host copies and device views (`views.py`), the on-demand
forward (`forward.py`), the lifecycle (`offloader.py`).
"""

from offload.executors.uva.offloader import UVAOffloader

__all__ = ["UVAOffloader"]
