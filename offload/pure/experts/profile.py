"""Routing profiles: checking one against a model (`check_profile`), the experts it says
to hold (`held_from_profile`), its JSON form (`profile_to_json`, `profile_from_json`),
and the profile of a trace (`trace_profile`); a trace's JSON form (`trace_to_json`,
`trace_from_json`)."""

from __future__ import annotations

import json
from typing import TypeVar

from offload.errors import OffloadError, PlanError
from offload.pure._checks import is_int
from offload.pure.experts.values import RoutingProfile, RoutingTrace
from offload.pure.serialize import from_data, parse_json, short_repr, to_data
from offload.pure.spec.experts import ExpertGroup

__all__ = ["PROFILE_FORMAT", "TRACE_FORMAT", "check_profile", "held_from_profile", "profile_from_json",
           "profile_to_json", "trace_from_json", "trace_profile", "trace_to_json"]

#: The ``format`` of a routing profile's JSON document.
PROFILE_FORMAT = "offload-routing-profile/1"
#: The ``format`` of a routing trace's JSON document.
TRACE_FORMAT = "offload-routing-trace/1"

_Value = TypeVar("_Value", RoutingProfile, RoutingTrace)


def check_profile(profile: RoutingProfile, groups: tuple[ExpertGroup, ...]) -> None:
    """Raise `PlanError` unless `profile` is of the model whose experts modules are
    `groups`: the same modules (by layer and module) and one count per expert.

    Raises:
        PlanError: naming the first module the profile lacks, then the first it has that
            the model does not, then the first whose counts are not E long.
    """
    if not isinstance(profile, RoutingProfile):
        raise PlanError(f"profile must be a RoutingProfile, got {profile!r}", name="profile", value=profile)
    counts = {(layer, module): c for layer, module, c in profile.counts}
    wanted = {(g.layer, g.module): g for g in groups}
    for key in wanted:
        if key not in counts:
            raise PlanError(f"the routing profile has no experts module {key[0]}:{key[1]}; it is not of this model",
                            name="profile", value=key)
    for key in counts:
        if key not in wanted:
            raise PlanError(f"the routing profile names experts module {key[0]}:{key[1]}, which this model does not "
                            "have; it is not of this model", name="profile", value=key)
    for key, group in wanted.items():
        if len(counts[key]) != group.num_experts:
            raise PlanError(f"the routing profile counts {len(counts[key])} experts for {key[0]}:{key[1]}, which "
                            f"has {group.num_experts}; it is not of this model", name="profile",
                            value=len(counts[key]))


def held_from_profile(profile: RoutingProfile, group: ExpertGroup, slots: int) -> tuple[int, ...]:
    """The experts of `group` to hold: the most often routed, at most `slots` of them,
    only those routed at all, ties to the lower index; sorted.

    Raises:
        PlanError: the profile has no entry for `group`, or its counts are not E long, or
            `slots` is not an integer >= 0.
    """
    if not is_int(slots) or slots < 0:
        raise PlanError(f"slots must be an integer >= 0, got {slots!r}", name="slots", value=slots)
    counts = next((c for layer, module, c in profile.counts if (layer, module) == (group.layer, group.module)), None)
    if counts is None:
        raise PlanError(f"the routing profile has no experts module {group.layer}:{group.module}", name="profile",
                        value=(group.layer, group.module))
    if len(counts) != group.num_experts:
        raise PlanError(f"the routing profile counts {len(counts)} experts for {group.layer}:{group.module}, which "
                        f"has {group.num_experts}", name="profile", value=len(counts))
    hottest = sorted((expert for expert, count in enumerate(counts) if count > 0),
                     key=lambda expert: (-counts[expert], expert))
    return tuple(sorted(hottest[:slots]))


def profile_to_json(profile: RoutingProfile, *, indent: int | None = None) -> str:
    """The profile as a `PROFILE_FORMAT` document; `profile_from_json` reads it back equal."""
    return _write(PROFILE_FORMAT, "profile", profile, indent)


def profile_from_json(text: str | bytes) -> RoutingProfile:
    """Read a profile written by `profile_to_json`; the text is untrusted.

    Raises:
        PlanError: the text is not JSON (see `offload.pure.serialize.parse_json`), not a
            `PROFILE_FORMAT` document, or its profile breaks a rule of `RoutingProfile`.
    """
    return _read(text, PROFILE_FORMAT, RoutingProfile, "profile")


def trace_to_json(trace: RoutingTrace, *, indent: int | None = None) -> str:
    """The trace as a `TRACE_FORMAT` document; `trace_from_json` reads it back equal."""
    return _write(TRACE_FORMAT, "trace", trace, indent)


def trace_from_json(text: str | bytes) -> RoutingTrace:
    """Read a trace written by `trace_to_json`; the text is untrusted.

    Raises:
        PlanError: the text is not JSON (see `offload.pure.serialize.parse_json`), not a
            `TRACE_FORMAT` document, or its trace breaks a rule of `RoutingTrace`.
    """
    return _read(text, TRACE_FORMAT, RoutingTrace, "trace")


def _write(fmt: str, key: str, value: RoutingProfile | RoutingTrace, indent: int | None) -> str:
    """`value` under `key` of a `fmt` document."""
    return json.dumps({"format": fmt, key: to_data(value)}, indent=indent)


def _read(text: str | bytes, fmt: str, cls: type[_Value], key: str) -> _Value:
    """The `cls` under `key` of a `fmt` document."""
    document = parse_json(text)
    if not isinstance(document, dict) or document.get("format") != fmt:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise PlanError(f"not an {fmt} document (format is {short_repr(found)})", name="format", value=found)
    try:
        return from_data(cls, document.get(key))
    except PlanError:
        raise
    except OffloadError as exc:
        raise PlanError(f"the routing {key} breaks a rule: {exc}", name=exc.name, value=exc.value) from exc


def trace_profile(trace: RoutingTrace) -> RoutingProfile:
    """The profile of a trace: per module, the calls that routed each expert (a trace
    records which experts a call routes, not how many of its tokens each; a recorded
    profile counts tokens)."""
    counts = []
    for g, group in enumerate(trace.groups):
        per_expert = [0] * group.num_experts
        for step in trace.steps:
            for expert in step[g]:
                per_expert[expert] += 1
        counts.append((group.layer, group.module, tuple(per_expert)))
    return RoutingProfile(counts=tuple(counts))
