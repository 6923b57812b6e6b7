"""The check made before each run of a prefetched layer: each of its offloaded parameters
is still the one its module holds, still points at its slot, and was not written in place.

A layer is checked on every forward, so the check is cheap: for each layer it is one
function generated at `post_init` (`compile_check`) whose body is a single boolean
expression over the layer's parameters, with their expected data pointers and version
counters as constants (as ``attrs`` generates its methods), not a loop over tuples. It is
generated again whenever the expected values change (new weights loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["Bound", "Check", "compile_check", "first_changed"]

#: One offloaded parameter as post_init bound it: (the ``_parameters`` dict of the module
#: holding it, its key there, the Parameter, its data pointer (a slot buffer's), its
#: version counter then).
Bound = tuple[dict[str, Any], str, nn.Parameter, int, int]

#: True when every parameter of the layer is as bound.
Check = Callable[[], bool]


def compile_check(entries: Sequence[Bound], *, versions: bool) -> Check:
    """A function that is True when every one of `entries` is as bound: held by its module
    under its key, pointing at its data pointer, and (with `versions`) at its version.

    Args:
        entries: the layer's bound parameters.
        versions: compare version counters too (the eager path; the custom ops' declared
            mutations move them under torch.compile).

    Returns:
        The check; with no entries, one that is always True.
    """
    namespace: dict[str, Any] = {}
    terms = []
    for index, (params, leaf, param, pointer, version) in enumerate(entries):
        namespace[f"d{index}"] = params
        namespace[f"p{index}"] = param
        term = f"d{index}.get({leaf!r}) is p{index} and p{index}.data_ptr() == {int(pointer)}"
        if versions:
            term += f" and p{index}._version == {int(version)}"
        terms.append(term)
    source = f"def check():\n    return {' and '.join(terms) or 'True'}\n"
    exec(compile(source, "<offload bound check>", "exec"), namespace)  # noqa: S102  # code made here, from ints and reprs
    check: Check = namespace["check"]
    return check


def first_changed(entries: Sequence[Bound], *, versions: bool) -> int:
    """The index of the first of `entries` that is not as bound (the slow path, once a
    check failed), or -1."""
    for index, (params, leaf, param, pointer, version) in enumerate(entries):
        if params.get(leaf) is not param or param.data_ptr() != pointer or (versions and param._version != version):
            return index
    return -1
