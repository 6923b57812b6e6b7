"""The device expert cache: each offloaded mixture-of-experts layer's experts served
expert by expert, as the routing asks (`ExpertCaches`), from the plan's
`ExpertCachePlan`s (`offload.pure.experts`); and the routing of a model recorded from its
forwards (`record_routing`), as a profile or a trace.

The rules it keeps are Note [expert cache], written with the prefetch backend's notes
(`offload.executors.prefetch`), which runs it.
"""

from offload.executors.experts.cache import ExpertCaches
from offload.executors.experts.record import RoutingRecord, record_routing

__all__ = ["ExpertCaches", "RoutingRecord", "record_routing"]
