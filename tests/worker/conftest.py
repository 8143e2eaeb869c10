"""Fixtures of the tests that talk to a real vLLM server (the others are tests/fixtures/)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from refit_worker.contract import CLIENT_KEEPALIVE_SECONDS


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One HTTP client per test module, for the module's server (a load or a layout's
    collective call on two CPU cores takes up to minutes: hence the long timeout). Idle
    connections expire before vLLM closes them, as the operator's do."""
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_SECONDS)
    with httpx.Client(timeout=120, limits=limits) as c:
        yield c
