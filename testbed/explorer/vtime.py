"""Virtual time for the explorer: an asyncio loop whose clock only moves when nothing is ready.

The loop is asyncio's own selector loop; only its selector's wait is replaced: where the real
one would block until the next timer, the virtual one moves the clock to that timer at once.
So ``asyncio.sleep(600)`` costs nothing, timeouts fire in schedule order, and a run is a
function of its seed. The operator reads the same clock through ``refit_operator.core.times``.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

EPOCH = 1_800_000_000.0  # the virtual wall clock starts here (2027-01-15)


class Stalled(RuntimeError):
    """Every task waits and no timer is set: nothing can ever happen again."""


class VirtualClock:
    """The virtual clock: wall time (``time``) and monotonic time move together."""

    def __init__(self, start: float = EPOCH) -> None:
        self.start = start
        self.elapsed = 0.0

    def time(self) -> float:
        return self.start + self.elapsed

    def monotonic(self) -> float:
        return self.elapsed

    def advance(self, seconds: float) -> None:
        self.elapsed += max(seconds, 0.0)


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        ready: list[Any] = super().select(0)  # the loop's own self-pipe only
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stalled("no task can run and no timer is set")
        self.clock.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_VirtualSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.monotonic()
