"""Fixtures for the chart tests."""

from __future__ import annotations

import pytest

from tests.chart.chartkit import Helm, helm_binary


@pytest.fixture(scope="session")
def helm() -> Helm:
    """The real Helm 3 binary (installed into ~/.cache/refit/bin by hack/helm.sh)."""
    return Helm(helm_binary())
