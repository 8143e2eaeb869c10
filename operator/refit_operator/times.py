"""Kubernetes timestamps (RFC 3339, UTC): the one place they are written and parsed; and the
operator's clock, one seam that a deterministic test replaces with virtual time. Pure."""

from __future__ import annotations

import time as _time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Protocol


def rfc3339(ts: float) -> str:
    """Seconds since the epoch as metav1.Time writes it: ``2026-12-01T13:36:27Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_micro(ts: float) -> str:
    """As metav1.MicroTime writes it (a Lease's renewTime): ``…T13:36:27.123456Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse(text: object) -> datetime | None:
    """An RFC 3339 timestamp (with or without fractions; ``Z`` or an offset; no zone is
    taken as UTC, as Kubernetes writes it) as an aware datetime; None when unset or
    unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def epoch(text: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 timestamp; None when unset or unreadable."""
    parsed = parse(text)
    return parsed.timestamp() if parsed is not None else None


class Clock(Protocol):
    """Where the operator reads the time: the system's, or a test's virtual clock."""

    def time(self) -> float: ...  # seconds since the epoch (timestamps, deadlines in records)

    def monotonic(self) -> float: ...  # for durations and local deadlines


_clock: Clock = _time  # the module `time` has both functions


def now() -> float:
    """Seconds since the epoch, from the operator's clock (time.time() in production)."""
    return _clock.time()


def monotonic() -> float:
    """The operator's monotonic clock (time.monotonic() in production)."""
    return _clock.monotonic()


@contextmanager
def using(clock: Clock) -> Iterator[None]:
    """Run the operator on ``clock`` (the deterministic explorer's virtual time) meanwhile."""
    global _clock
    before, _clock = _clock, clock
    try:
        yield
    finally:
        _clock = before
