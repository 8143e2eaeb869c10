"""A real Prometheus scrapes a live /metrics endpoint fed by the operator's metrics functions;
every dashboard panel query and every alert expression must return data from it.

This module drives refit_operator.edges.metrics with tests/observability/driver.py (a realistic
sequence of calls, three fleets ending in the states the alerts are about). The same checks run
against the real operator during real refits in test_operator_scrape.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, start_http_server
from refit_operator.edges.metrics import Metrics

from testbed.controlplane import free_port
from testbed.prometheus import PrometheusServer
from tests.observability import artifacts, driver

FLEET_REGEX = "|".join(driver.FLEETS)


def _finite(result: list[dict[str, Any]]) -> bool:
    values = [
        float(v)
        for r in result
        for v in ([r["value"][1]] if "value" in r else [p[1] for p in r["values"]])
    ]
    return any(math.isfinite(v) for v in values)


def test_dashboards_and_alerts_evaluate_against_a_live_scrape(
    prometheus: Callable[..., PrometheusServer],
) -> None:
    # The operator's reconcile loop last succeeded 15 minutes ago (RefitOperatorNotReconciling).
    m = Metrics(CollectorRegistry(), clock=lambda: time.time() - 900)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    try:
        prom = prometheus([f"127.0.0.1:{port}"], rule_files=[artifacts.ALERTS])
        began = time.time()
        scrapes = 0
        for stage in driver.STAGES:
            stage(m, time.time())
            scrapes += 3  # let a few scrapes see each stage, so counters visibly grow
            prom.wait_for(f'count_over_time(up{{job="{prom.job}"}}[10m]) >= {scrapes}', timeout=30)
        prom.wait_scraped(scrapes=scrapes)
        end = time.time()
        range_ = f"{math.ceil(end - began) + 60}s"

        checked = 0
        for q in artifacts.panel_queries():
            expr = artifacts.grafana_substitute(
                q.expr, namespace=driver.NS, fleet=FLEET_REGEX, range_=range_
            )
            if q.instant:
                result = prom.query(expr, at=end)
            else:
                result = prom.query_range(expr, began, end, step=1.0)
            assert result, f"{q.panel} [{q.ref}] returned no data: {expr}"
            assert _finite(result), f"{q.panel} [{q.ref}] returned only NaN: {expr}"
            checked += 1
        assert checked == len(artifacts.panel_queries()) >= 20

        # Variable queries, the way Grafana's Prometheus data source runs label_values().
        names = httpx.get(f"{prom.url}/api/v1/label/namespace/values").json()["data"]
        assert driver.NS in names
        fleets = httpx.get(
            f"{prom.url}/api/v1/series",
            params={"match[]": f'refit_fleet_target_version_info{{namespace=~"{driver.NS}"}}'},
        ).json()["data"]
        assert {s["fleet"] for s in fleets} == set(driver.FLEETS)

        # Every alert expression returns data, and Prometheus' own rule evaluation has the
        # alert pending or firing, with the labels the runbook talks about.
        expected = {
            "RefitProbeFailing": {"fleet": "app=rollout", "pod": "vllm-3"},
            "RefitProbeInconclusive": {"fleet": "app=canary", "pod": "canary-0"},
            "RefitStuck": {"fleet": "app=canary", "refit": "step-8"},
            "RefitVersionSkew": {"fleet": "app=eval"},
            "RefitPodsOutOfTraffic": {"fleet": "app=rollout"},
            "RefitOutOfTrafficSlow": {"fleet": "app=eval"},
            "RefitOperatorNotReconciling": {"job": prom.job},
            "RefitReconcileErrors": {"job": prom.job},
        }
        rules = {r.alert: r for r in artifacts.alert_rules()}
        assert set(expected) | {"RefitOperatorDown"} == set(rules)
        for alert, labels in expected.items():
            result = prom.query(rules[alert].expr)
            assert result, f"{alert}: expression returned no data"
            assert any(labels.items() <= r["metric"].items() for r in result), (alert, result)
        _wait_alerts(prom, expected)
        # Fleets that are fine do not show up in the fleet alerts.
        skew = prom.query(rules["RefitVersionSkew"].expr)
        assert {r["metric"]["fleet"] for r in skew} == {"app=eval"}
        # app=rollout's pods came back in seconds: only app=eval's 8 minutes are slow.
        slow = prom.query(rules["RefitOutOfTrafficSlow"].expr)
        assert {r["metric"]["fleet"] for r in slow} == {"app=eval"}
    finally:
        server.shutdown()
        thread.join(5)

    # The endpoint is gone: up drops to 0 and RefitOperatorDown's expression returns data.
    prom.wait_for(f'up{{job="{prom.job}"}} == 0', timeout=30)
    assert prom.query(rules["RefitOperatorDown"].expr)
    _wait_alerts(prom, {"RefitOperatorDown": {}})


def _wait_alerts(prom: PrometheusServer, expected: dict[str, dict[str, str]]) -> None:
    deadline = time.monotonic() + 30
    while True:
        alerts = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        active = {
            name
            for name, labels in expected.items()
            if any(
                a["labels"]["alertname"] == name
                and a["state"] in ("pending", "firing")
                and labels.items() <= a["labels"].items()
                for a in alerts
            )
        }
        if active == set(expected):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"alerts never became active: {set(expected) - active}")
        time.sleep(0.5)
