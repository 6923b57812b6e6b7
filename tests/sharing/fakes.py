"""Fake CUDA registration calls for the sharing tests (a fake, not a mock: it records)."""

from __future__ import annotations

import attrs

from offload.sharing.pinning import PinCalls

__all__ = ["FakePins"]


@attrs.define
class FakePins:
    """Records registrations; fails the ones whose index is in `fail`."""

    fail: set[int] = attrs.Factory(set)
    registered: list[tuple[int, int, int]] = attrs.Factory(list)
    unregistered: list[int] = attrs.Factory(list)

    def calls(self) -> PinCalls:
        def register(pointer: int, nbytes: int, flags: int) -> int:
            index = len(self.registered)
            self.registered.append((pointer, nbytes, flags))
            return 1 if index in self.fail else 0

        def unregister(pointer: int) -> int:
            self.unregistered.append(pointer)
            return 0

        return PinCalls(register=register, unregister=unregister)
