"""Kubernetes timestamps (RFC 3339, UTC): the one place they are written and parsed. Pure."""

from __future__ import annotations

from datetime import UTC, datetime


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
