"""Fixtures for the chart tests."""

from __future__ import annotations

import pytest

from testbed.controlplane import ControlPlane
from tests.chart.chartkit import MONITORING_CRDS, Helm, helm_binary, prometheus_operator_crds


@pytest.fixture(scope="session")
def helm() -> Helm:
    """The real Helm 3 binary (installed into ~/.cache/refit/bin by hack/helm.sh)."""
    return Helm(helm_binary())


@pytest.fixture(scope="session")
def monitoring_crds(control_plane: ControlPlane) -> list[str]:
    """The real ServiceMonitor and PrometheusRule CRDs of the Prometheus Operator, installed
    in the test API server, so the chart's monitoring objects meet their actual schemas.
    Returns the kinds."""
    folder = prometheus_operator_crds()
    for file in MONITORING_CRDS.values():
        control_plane.kubectl("apply", "--server-side", "-f", str(folder / file))
    for file in MONITORING_CRDS.values():
        control_plane.kubectl(
            "wait", "--for=condition=Established", "-f", str(folder / file), "--timeout=30s"
        )
    return list(MONITORING_CRDS)
