"""The loggers `offload` writes to, named once: a user's logging configuration names these,
and they do not move when a module does (docs/observability.md lists them; a test holds
the list to the code and the page).

Every module that logs takes its logger from `logger`, with one of the names below; the
core (`offload.pure`) never logs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["LOGGERS", "logger"]

#: Each logger's name and what it tells, in the order docs/observability.md lists them.
LOGGERS: Mapping[str, str] = MappingProxyType({
    "offload": "the parent of every logger below (configure it to hear them all)",
    "offload.env": "what the machine was found to be: the CUDA probes, /proc, cgroups, NUMA",
    "offload.plan": "what was chosen before anything moved: the fit, the disk tier, what stays whole",
    "offload.load": "loading and moving weights: checkpoints, wrap and restore, new weights, progress",
    "offload.prefetch": "the prefetch executor: realignments, copies refused or repeated",
    "offload.uva": "the UVA executor and its on-demand fallback",
    "offload.disk": "the disk tier: reads, the staging ring, spill files, read fallbacks",
    "offload.host": "host memory: pinning and its fallbacks, NUMA placement",
    "offload.compile": "torch.compile and CUDA graph capture",
    "offload.sharing": "host copies shared among processes",
    "offload.stats": "the periodic stats line (`log_stats_every`)",
    "offload.demo": "`offload demo`'s steps",
})


def logger(name: str) -> logging.Logger:
    """The logger `name`, one of `LOGGERS`.

    Raises:
        ValueError: `name` is not one of them (a logger nobody could configure by its documented name).
    """
    if name not in LOGGERS:
        raise ValueError(f"{name!r} is not one of offload's loggers ({', '.join(LOGGERS)})")
    return logging.getLogger(name)
