"""Kubernetes timestamps (RFC 3339, UTC): the one place they are written and parsed, and the
one order of WeightRefits by creation (which of two is newer); and the operator's clock, one
seam that a deterministic test replaces with virtual time. Pure."""

from __future__ import annotations

import re
import time as _time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

from refit_worker.contract import API_GROUP

# When the WeightRefit was created, to the nanosecond (``stamp``): written by RefitClient in
# the body it creates, else by the operator the first time it sees the refit. The API server's
# creationTimestamp has one-second resolution, and a trainer creates refits faster than that.
CREATED_ANNOTATION = f"{API_GROUP}/created"
_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z")


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


def stamp(ns: int) -> str:
    """Nanoseconds since the epoch as ``CREATED_ANNOTATION`` holds them:
    ``…T13:36:27.123456789Z``, fixed width, so that text order is time order."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{fraction:09d}Z"


def stamp_of(meta: Mapping[str, Any]) -> str:
    """The creation stamp a WeightRefit's metadata carries; "" when it has none, or none in
    the one fixed-width form (anything else would not sort in time order)."""
    text = (meta.get("annotations") or {}).get(CREATED_ANNOTATION)
    return text if isinstance(text, str) and _STAMP.fullmatch(text) else ""


def creation_order(created: str, stamp: str = "") -> str:
    """A WeightRefit's place in creation order, as one text that sorts in that order: the API
    server's creationTimestamp first (one clock for every creator; the stamps of two clients
    are only compared within one second of it), then the creation stamp. A refit without a
    stamp sorts before every stamped one of its second."""
    return f"{created} {stamp}" if stamp else created


def order_of(meta: Mapping[str, Any]) -> str:
    """``creation_order`` of a WeightRefit's metadata."""
    return creation_order(str(meta.get("creationTimestamp") or ""), stamp_of(meta))


def order_key(order: str, name: str) -> tuple[str, str]:
    """The one key every comparison of WeightRefits by age uses: creation order, then the
    name, only for two refits whose stamps tie (or that have none in the same second)."""
    return (order, name)


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
