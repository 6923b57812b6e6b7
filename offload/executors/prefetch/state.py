"""What a prefetch offloader holds: every field, set once here with what it means, and
the reads every part needs (the plan, a host copy, an event on the compute stream, the
counters).

The parts build on it in one line, each using only what lies below it: `CopyQueue`
(`queue.py`) → `ForwardPath` (`forward.py`) → `NewWeights` (`weights.py`) →
`PrefetchOffloader` (`offloader.py`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload.errors import PlanError
from offload.executors.bound import Bound, Check
from offload.executors.common import Patched, Ref, host_of, raise_as_execution_error
from offload.executors.experts import ExpertCaches
from offload.executors.hoststore import HostSource, HostStore
from offload.executors.lifecycle import Lifecycle
from offload.executors.placement.restore import Restorer
from offload.executors.prefetch.buffers import Buffers, Chunks, copy_after
from offload.executors.prefetch.disk import DiskIO, DiskStream
from offload.executors.telemetry import StepLog
from offload.protocols import Event, Runtime
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.stats import OffloadStats

__all__ = ["InFlight", "PrefetchState"]

#: A copy in flight for a position's next run: its done event, and whether it was issued
#: inside a CUDA graph capture (Note [in flight]). Immutable: it crosses from the copy
#: stream's side (`_issue`) to the compute stream's (`_wait_at`) as a value.
InFlight = tuple[Event, bool]


class PrefetchState:
    """The fields of a prefetch offloader and their meaning (see `PrefetchOffloader`)."""

    def __init__(self, plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None, *,
                 disk: DiskTierPlan | None = None, spill_dir: str | os.PathLike[str] | None = None,
                 disk_io: DiskIO | None = None) -> None:
        if plan.backend is not Backend.PREFETCH:
            raise PlanError(f"PrefetchOffloader runs prefetch plans, got backend {plan.backend.value}",
                            name="backend", value=plan.backend.value)
        if disk is not None and host_source is not None:
            raise PlanError("a disk tier cannot be combined with host copies from another source (a sharing "
                            "group): plan without the disk tier, or do not share", name="disk", value=True)
        self._plan = plan
        self._rt = runtime
        self._state = Lifecycle.NEW
        self._layers: list[nn.Module] = []
        # The disk tier (Note [disk tier]): its parameters' host copies lie in their files.
        self._disk = DiskStream(plan, disk, spill_dir=spill_dir, io=disk_io) if disk is not None else None
        source = self._disk.host if self._disk is not None else host_source
        self._host = HostStore(runtime, pin=plan.pin.method, source=source)  # owner (layer, name) -> host copy
        self._origin: dict[Ref, torch.device] = {}  # every offloaded (layer, name) -> where restore puts it
        self._restorer: Restorer | None = None
        self._hooks: list[Any] = []  # state_dict hook handles
        self._patched: dict[int, Callable[..., Any] | None] = {}  # layer index -> previous forward attr
        self._guards: Patched = []  # the other layers' refusing forwards while a restore is unfinished
        # position -> its copies, each as the runtime cuts it (`PreparedCopies`, worked out
        # at post_init) or as one (buffer, host) pair for `copy_after`; `_copy` issues one.
        self._copies: list[list[Chunks]] = []
        self._copy: Callable[[Chunks, Event | None], Event] = functools.partial(copy_after, runtime)
        # position -> its offloaded parameters as post_init left them, checked before each
        # run (`_wait_at`), and their names within the layer, for messages.
        self._bound: list[list[Bound]] = []
        self._bound_names: list[list[str]] = []
        self._checks: list[Check] = []  # position -> its check (`offload.executors.bound`), versions included
        self._checks_traced: list[Check] = []  # the same without versions, for the custom ops' path
        self._ops_ran = False  # the custom ops' path ran since the versions were taken (Note [compiled then eager])
        # id of an offloaded Parameter -> (it, the owner of its host copy): what a
        # conversion (`model.to()`, `_apply`) converts instead of its slot (post_init).
        self._convert_from: dict[int, tuple[nn.Parameter, Ref]] = {}
        # Disk parameters ``load_state_dict`` is writing (`_route_begin`): id -> (the
        # Parameter, its owner, the host tensor it points at meanwhile, its version then).
        self._renewing: dict[int, tuple[nn.Parameter, Ref, torch.Tensor, int]] = {}
        # id of a module holding offloaded parameters -> (it, its entries: (key in its
        # _parameters, the Parameter, owner of its host copy, its slot data)), for
        # load_state_dict routing; id of a bound Parameter -> where it is in _bound
        # (position, index), once per name it has (post_init).
        self._held: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, Ref, torch.Tensor]]]] = {}
        self._entries_of: dict[int, list[tuple[int, int]]] = {}
        self._load_hooks: list[Any] = []  # load_state_dict hook handles (post_init)
        self._reload_due: set[int] = set()  # cycles whose host copies load_state_dict wrote: slots to refill
        self._apply_patched: list[tuple[nn.Module, Callable[..., Any] | None]] = []  # holder -> previous _apply
        self._copy_bytes: list[int] = []  # position -> bytes its copies move (post_init)
        self._slot_params: dict[int, tuple[nn.Parameter, ...]] = {}  # layer -> its slot parameters (post_init)
        self._buffers: Buffers = {}
        # The device expert caches (Note [expert cache]; installed at post_init, from the
        # plan as post_init revised it).
        self._experts = ExpertCaches((), runtime)
        # Per position, the copy in flight for its next run (Note [in flight]). A position
        # in `_landed` has its weights in its slot with nothing to wait for (Note [capture
        # boundary]).
        self._pending: dict[int, InFlight] = {}
        self._landed: set[int] = set()
        self._position_of: dict[int, int] = {}  # offloaded layer -> schedule position (post_init)
        self._next_after: tuple[int | None, ...] = ()  # the schedule's next_after, kept positions left out (post_init)
        self._kept: tuple[bool, ...] = ()  # position -> whether it is kept (the only owner of its slot; post_init)
        self._successor: tuple[int, ...] = ()  # position -> the position expected after it (post_init)
        # The schedule's cycles, one per stack (Note [cycles]; post_init): position -> its
        # cycle; per cycle, its first position, its (first, stop) and its initial copies.
        self._cycle_of: tuple[int, ...] = ()
        self._cycle_first: tuple[int, ...] = (0,)
        self._cycle_ranges: tuple[tuple[int, int], ...] = ()
        self._initial_of: tuple[tuple[int, ...], ...] = ()
        self._dropped = 0
        # Per cycle, the schedule position expected next; the cycles whose layers get their
        # copy when they run until the cycle's next step begins (Note [realign]).
        self._expected: list[int] = [0]
        self._recovering: set[int] = set()
        self._realignments = 0
        self._copies_issued = 0
        self._bytes_copied = 0
        self._timed_bytes = 0  # of copies issued outside a CUDA graph capture (the runtime times those)
        self._steps = 0
        self._step_log = StepLog()
        self._handle = 0

    @property
    def plan(self) -> OffloadPlan:
        """The plan being run; after `post_init`, revised for parameters that post-processing
        replaced or deleted."""
        return self._plan

    def _host_of(self, ref: Ref) -> torch.Tensor:
        return host_of(self._host, ref)

    def _record(self) -> Event:
        try:
            return self._rt.record()
        except BaseException as exc:
            raise_as_execution_error(exc, "recording an event on the compute stream failed", "forward")

    def stats(self) -> OffloadStats:
        """Counters since `wrap_modules` (see `OffloadStats`)."""
        active = self._state in (Lifecycle.WRAPPED, Lifecycle.READY)
        disk = self._disk
        read, read_seconds, disk_wait, misses = disk.reads() if disk is not None else (0, 0.0, 0.0, 0)
        expert_copies, expert_bytes = self._experts.copied()
        return OffloadStats(
            params_offloaded=len(self._plan.offloaded_params) if active else 0,
            params_dropped=self._dropped,
            host_bytes=self._host.nbytes + (disk.staging_bytes if disk is not None else 0),
            device_buffer_bytes=sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                     for slots in self._buffers.values() for t in slots.values()}.values())
            + self._experts.slot_bytes(),
            copies_issued=self._copies_issued + expert_copies,
            bytes_copied=self._bytes_copied + expert_bytes,
            wait_seconds=self._rt.waited_seconds(),
            pin_fallbacks=self._host.fallbacks + (disk.fallbacks if disk is not None else 0),
            realignments=self._realignments,
            steps=self._steps,
            copy_seconds=self._rt.copy_seconds(),
            timed_bytes=self._timed_bytes,
            disk_layers=len(disk.tier.disk_positions) if disk is not None else 0,
            disk_bytes_read=read,
            disk_read_seconds=read_seconds,
            disk_wait_seconds=disk_wait,
            disk_misses=misses,
            experts=self._experts.counts(),
        )

    def log_stats_every(self, steps: int | None = None, seconds: float | None = None) -> None:
        """Log one line of `stats()` (logger ``offload.stats``, INFO) every `steps` forward
        steps and/or every `seconds` seconds (checked at each step); no arguments: stop.

        Raises:
            ExecutionError: `steps` or `seconds` is not a positive number.
        """
        self._step_log.configure(steps, seconds)
