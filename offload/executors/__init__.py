"""Executors: each runs one backend's plans and decides nothing the plan has not decided."""

from offload.executors.noop import NoopOffloader
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.uva import UVAOffloader

__all__ = ["NoopOffloader", "PrefetchOffloader", "UVAOffloader"]
