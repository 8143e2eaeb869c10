"""Fixtures of the tests that talk to a real vLLM server (the others are tests/fixtures/)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One HTTP client per test module, for the module's server (a load or a layout's
    collective call on two CPU cores takes up to minutes: hence the long timeout)."""
    with httpx.Client(timeout=120) as c:
        yield c
