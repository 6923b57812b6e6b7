"""The prefetch backend: weights in host memory, streamed into static device buffers a few
layers ahead of the compute that reads them (`PrefetchOffloader`).

The offloader is built in one line of parts, each using only what lies below it:

- `state.py`: every field and what it means (`PrefetchState`).
- `buffers.py`: the static buffers, slot arenas, and each copy cut once (post_init).
- `queue.py`: the copy queue: issue, wait, realign, the CUDA graph calls (`CopyQueue`).
- `forward.py`: the forwards installed on the layers, eager and compiled (`ForwardPath`).
- `weights.py`: the per-layer check, conversions, new weights (`NewWeights`).
- `disk.py`: the disk tier's ring and files, from post_init to restore (`DiskStream`).
- `offloader.py`: the lifecycle: wrap, post_init, restore, stats (`PrefetchOffloader`).

The rules the parts keep are written once, here, as named notes; the code says
``Note [...]`` where it relies on one (a test holds every reference to a note below).

Note [ordering]
    Position ``i`` (the i-th offloaded layer) runs as: wait for its copy's done event; run
    the layer; record an event on the compute stream; issue the copy the schedule names
    (``next_after[i]``) on the copy stream after that event. The schedule's proof
    (`check_schedule`) guarantees that copy goes into a slot whose previous owner has run,
    and the event guarantees the owner's kernels are finished before the copy overwrites
    it. The eager forward calls the queue directly; under torch.compile the wait and the
    start are custom ops that declare the slot tensors mutated, so the compiler keeps
    that order (`offload.executors.ops`).

Note [in flight]
    Each position has at most one copy in flight for its next run, kept as an immutable
    value (`InFlight`: its done event, and whether it was issued inside a CUDA graph
    capture). Issuing puts it, waiting takes it: the copy stream's side and the compute
    stream's side share nothing else. A position with no copy in flight when it runs has
    lost its copy (a forward stopped part way, a failed copy) and realigns.

Note [kept position]
    A position that is the only owner of its slot is loaded by the step's first copies and
    stays loaded: no copy is issued for it again (`PrefetchSchedule.issued_after` leaves it
    out), and it keeps its one copy's event, which every step waits on again (free once
    done), on whatever stream runs the layer then.

Note [capture boundary]
    `sync_prev_onload` before a capture or replay makes every earlier copy complete, so
    inside the capture the waits for copies issued before it are skipped (their events
    cannot be waited on from a capture). Copies issued inside it are waited on by event,
    and `join_after_forward` joins those still outstanding before the capture ends; those
    positions then count as landed: a capture executes nothing, so after it the slots hold
    what they held before it, and each replay refills them before it ends. Capturing
    needs pinned host copies (PyTorch refuses pageable host-to-device copies in a capture).

Note [realign]
    A position that runs when the schedule expected another (layers skipped, run out of
    order or twice, a forward stopped part way) puts the schedule right so the weights
    are correct whatever the order. At the first position a new step begins: everything
    in flight is finished and the step's first copies are issued as post_init does. At any
    other position the layer gets its own copy now, and so does every later one until the
    next step begins; nothing is prefetched meanwhile. Each realignment is counted and
    logged; inside a capture it is refused (the order must be the eager one).

Note [cycles]
    A model with several layer stacks (an encoder and a decoder, a vision tower and a
    language model) has one schedule cycle per stack (`PrefetchSchedule.cycles`), each
    with slots of its own. Each cycle keeps its own expected position and its own
    realignment: a decoder that runs once per token while its encoder runs once per
    request finds its copies in flight every time, whatever the other cycle did, and a
    realignment in one cycle leaves the others prefetching; new weights refill only the
    cycles whose host copies changed. A step (`stats().steps`, `log_stats_every`) is a
    run of a stack: one per forward of a one-stack model, one per encoder run and one per
    decoder token for an encoder and a decoder.

Note [conversions]
    ``model.to(dtype)``, ``.half()``, ``.cuda()`` go through ``nn.Module._apply(fn)``. On a
    prefetched parameter that would convert its slot, which holds whichever layer last ran
    there. Each module holding an offloaded parameter gets an instance ``_apply`` that
    hands ``fn`` the parameter's host copy instead; a conversion that changes nothing
    leaves the slot in place.

Note [new weights]
    New weights go into the host copies, never into a slot: `load_weights` writes them
    there, and ``load_state_dict`` is routed there (each holder's parameters point at
    their host copies while torch writes them). A disk weight's host copy lies in its
    file and is not written in place: its new values go to the spill file (for
    ``load_state_dict``, torch writes a host tensor that the holder's post-hook spills),
    that copy replaces the old one, the staging ring reads it from there, and a buffer
    already holding the old bytes is read again; all of a mapping's disk weights are
    written and flushed before any is taken, so a full spill disk leaves the old ones.
    Without a spill directory they are refused, naming the weight. Then the slots are
    refilled: the next forward begins a new step, without counting a realignment. A write
    into a slot itself (``param.copy_()``) is refused at the next forward (its version
    counter).

Note [compiled then eager]
    The eager check before each run compares each offloaded parameter's version counter
    with the one taken at post_init, so that a write into a slot (``param.copy_()``) is
    refused. The custom ops declare the slot tensors mutated, and where torch runs them
    outside a graph (a graph break) or writes a functionalised graph's mutations back,
    the counters move without any write of the user's. So once the compiled path has run
    (`wait_layer`, `start_after_layer`), an eager check that finds only counters moved
    (the parameters themselves and their buffers unchanged) takes them as they are and
    goes on; a write into a slot made between a compiled and an eager forward is then not
    seen (the next copy overwrites it). Before any compiled forward, and after each such
    acceptance until the ops run again, writes are refused as before.

Note [disk tier]
    With a disk tier (`offload.pure.disk.tier`) the copies of a disk position read its
    staging buffer (`offload.executors.staging`), not host copies: before they are issued
    the Python thread blocks until the buffer holds the position (reading it then if it
    does not), and after they are issued the buffer's next occupant in read order is
    staged, its reads to start on the reader's threads once that copy is done (a buffer
    is never refilled while a copy reads it); after a stack's last read of a buffer, the
    next occupant is the buffer's first read in the stack that usually runs next (each
    run's start tells the ring, `StagingRing.ran`). Post_init stages a pass's first reads; a
    copy that finds the wrong position in its buffer reads its own first, so every order
    of layers (realignment included) copies the right weights. A failed read fails the
    copy (the position then has nothing in flight and realigns: the next forward reads
    it again). The disk parameters' host copies are views over private mappings of their
    files (`offload.executors.diskhost`; a file mapped whole, or in segments, and open
    once: not an fd per tensor), for the cold paths only (restore, ``state_dict``, the
    live check); they are not written in place (new weights go to the spill file: Note
    [new weights]). CUDA graph capture is refused: the reads between the copies are not
    part of a graph.

Note [expert cache]
    An experts module's parameters are prefetched parameters (`OffloadPlan.experts`):
    they point at their slot buffers, E rows each, like every prefetched parameter, but
    the copy queue never copies them. At each call of the module the routed experts are
    read from its inputs (the routing indices, or the blocks the router's scores left
    non-zero: `Routing`), and the plan's policy (`offload.pure.experts.policy.admit`)
    says for each whether it is a hit (in a device slot of the cache) or a miss. Each
    miss is copied from its host copy into its row of the slot buffer on the copy stream,
    after an event recorded on the compute stream (whatever read the slot before has
    run), contiguous misses merged into one copy, and the compute stream waits for the
    last; each hit is copied from its cache slot into its row on the compute stream; a
    miss the policy keeps is copied from its row into its slot. The module then runs
    unchanged, with its own indices, over the slot buffers: every routed row holds its
    expert's weights, and the rows it does not read hold finite values (the buffers are
    zeroed at post_init and only ever receive weights), so its output is bit for bit the
    resident module's, for every experts implementation (each expert's rows are read in
    the module's own order). Bytes copied from the host per call: misses x the expert's
    bytes, exactly. New weights reset every cache (its slots hold old values). A CUDA
    graph capture is refused (the copies depend on the data), and torch.compile breaks
    its graph at the module's call.
"""

from offload.executors.prefetch.offloader import PrefetchOffloader

__all__ = ["PrefetchOffloader"]
