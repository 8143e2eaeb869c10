"""The real operator, during real refits on the real API server with simulated workers, scraped
by a real Prometheus: every metric name the dashboards and alerts use is in its /metrics, and
the dashboard queries and alert expressions are evaluated against what it exported.

Scenario (one fleet of 3 pods): refit wr-v1 succeeds after one transient sleep failure on
pod-0; refit wr-v2 halts because pod-2's probe sees a drift of 1 nat per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from refit_client.report import render_refit

from testbed.controlplane import ControlPlane, free_port
from testbed.fleet import Fleet, make_checkpoints
from testbed.operator_process import OperatorProcess
from testbed.prometheus import PrometheusServer
from tests.observability import artifacts

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# Panel queries and alert expressions that cannot return data from this scenario, and why.
# The test fails if anything else returns nothing; drop an entry once the operator feeds it.
AWAITING_OPERATOR: set[str] = set()
# Alerts this scenario produces (expression returns data, Prometheus has the alert pending).
EXPECTED_ALERTS = {
    # The refit label is whichever refit probed pod-2 last (the operator may bring the fleet
    # back to wr-v1's version after wr-v2 halts); the drift fault fails every probe of pod-2.
    "RefitProbeFailing": {"pod": "pod-2"},
    "RefitPodsOutOfTraffic": {},
    # wr-v2 halts with pod-2 on v2 (probe failed) and the rest on v1: the fleet is mixed, and
    # a halted refit is no longer active, so the skew alert starts its `for:` clock.
    "RefitVersionSkew": {"fleet": "app=rollout"},
}
# Alerts about conditions this scenario does not create; their firing is shown by the promtool
# unit tests and by test_prometheus_live.py.
QUIET_HERE = {
    "RefitProbeInconclusive": "no probe times out",
    "RefitStuck": "no refit outlives its timeout",
    # The simulated workers swap weights in milliseconds: every pod put back into traffic is
    # observed in the lowest bucket of refit_pod_out_of_traffic_seconds, far below 300 s.
    "RefitOutOfTrafficSlow": "pods are back in traffic within seconds",
    "RefitOperatorDown": "the operator is up",
    "RefitOperatorNotReconciling": "it reconciles every few seconds",
    "RefitReconcileErrors": "no reconcile fails",
}


@pytest.fixture
def operator_with_metrics(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str, tmp_path: Path
) -> Iterator[tuple[str, Callable[[], str]]]:
    """The real refit-operator process, its /metrics on a free loopback port."""
    port = free_port()
    op = OperatorProcess.start(
        control_plane.kubeconfig, namespace, tmp_path / "operator.log", identity="obs",
        metrics_port=port, metrics_addr="127.0.0.1",
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}", op.log_tail
    finally:
        op.stop(grace=5.0)


def _has_finite(result: list[dict[str, Any]]) -> bool:
    values = [r["value"][1] for r in result if "value" in r]
    values += [p[1] for r in result for p in r.get("values", [])]
    return any(math.isfinite(float(v)) for v in values)


def test_real_operator_metrics_feed_dashboards_and_alerts(
    operator_with_metrics: tuple[str, Callable[[], str]],
    prometheus: Callable[..., PrometheusServer],
    sim_fleet: Callable[..., Any],
    control_plane: ControlPlane,
    namespace: str,
    tmp_path: Path,
) -> None:
    target, operator_log = operator_with_metrics
    prom = prometheus([target], rule_files=[artifacts.ALERTS])
    fleet = Fleet(control_plane, namespace)
    try:
        sims = sim_fleet(3, allowed_root=tmp_path)
        ckpt = make_checkpoints(tmp_path, "v1", "v2")
        for i, sim in enumerate(sims):
            fleet.add_pod(f"pod-{i}", sim)
        began = time.time()
        prom.wait_scraped(scrapes=2, timeout=90)

        sims[0].set_fault("sleep", "error", 500, times=1)
        sims[1].set_fault("refit_load", "delay", 2.0)
        fleet.apply_refit("wr-v1", "v1", ckpt["v1"], sims[0].port)
        # A change to pod-1 the pass did not make, while it loads: the pass's next write meets
        # a conflict, finds its claim intact on a fresh read and retries (an API retry).
        fleet.wait_serving(sims[1], "refit_load")
        fleet.core.patch_namespaced_pod("pod-1", namespace, {"metadata": {"labels": {"x": "1"}}})
        doc = fleet.wait_phase("wr-v1", {"Succeeded", "Failed", "Halted"}, 90)
        assert doc["status"]["phase"] == "Succeeded", operator_log()
        sims[1].clear_faults()
        time.sleep(3)  # a few scrapes between the refits, so counters visibly grow

        sims[2].set_fault("completions", "drift", 1.0)
        fleet.apply_refit("wr-v2", "v2", ckpt["v2"], sims[0].port)
        doc = fleet.wait_phase("wr-v2", {"Succeeded", "Failed", "Halted"}, 90)
        assert doc["status"]["phase"] in ("Halted", "Failed"), operator_log()
        bad = {p["name"]: p for p in doc["status"]["pods"]}["pod-2"]
        assert bad["probe"]["verdict"] == "Fail"
        # The report draws what the real operator wrote: every pod, from the pods' records and
        # the status (which lists only pod-2, the one that needs attention).
        png = render_refit(doc, tmp_path / "wr-v2.png", pods=fleet.pods())
        assert png.stat().st_size > 20_000

        # The alerts' for: is at least 1m; pending is what "the expression returns data" means
        # to Prometheus' rule evaluation.
        prom.wait_for(
            'refit_probe_verdict{result="fail"} == 1', timeout=30, what="the failed verdict"
        )
        time.sleep(4)
        end = time.time()
    finally:
        fleet.close()

    # 1. Every metric name the dashboards and alerts use is in the operator's own /metrics.
    text = httpx.get(f"http://{target}/metrics", timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exposed = families | samples | {f"{f}_total" for f in families}
    used: set[str] = set()
    for q in artifacts.panel_queries():
        used |= artifacts.metric_names(q.expr)
    for rule in artifacts.alert_rules():
        used |= artifacts.metric_names(rule.expr)
    used.discard("up")
    missing = sorted(n for n in used if n not in exposed and artifacts.family(n) not in exposed)
    assert not missing, f"not in the operator's /metrics: {missing}"
    retries = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "refit_operator_api_retries_total" and s.labels.get("verb") == "patch"
    ]
    assert retries and retries[0] >= 1, f"the conflict on pod-1 was not counted: {retries}"
    # The tick that halted wr-v2 published the fleet as it left it: pod-2 out of traffic.
    out = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "refit_fleet_pods_out_of_traffic"
    ]
    assert out == [1.0], f"pod-2 (failed probe) is out of traffic: {out}"
    # Every pass that put a pod back into traffic was timed: wr-v1's three pods at least.
    back = {
        s.name.rsplit("_", 1)[1]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name
        in ("refit_pod_out_of_traffic_seconds_count", "refit_pod_out_of_traffic_seconds_sum")
    }
    assert back.get("count", 0) >= 3, f"pods put back into traffic were not observed: {back}"
    assert back["sum"] / back["count"] < 60, f"the simulated pods swap in seconds: {back}"

    # 2. Every dashboard query returns (finite) data, except those waiting on the operator.
    range_ = f"{math.ceil(end - began) + 60}s"
    no_data = []
    for q in artifacts.panel_queries():
        expr = artifacts.grafana_substitute(
            q.expr, namespace=namespace, fleet="app=rollout", range_=range_
        )
        result = prom.query(expr, at=end) if q.instant else prom.query_range(expr, began, end)
        if not _has_finite(result):
            no_data.append((q.panel, expr))
    unexplained = [
        (panel, expr)
        for panel, expr in no_data
        if not artifacts.metric_names(expr) & AWAITING_OPERATOR
    ]
    assert not unexplained, f"dashboard queries without data: {unexplained}"

    # 3. Alert expressions: those this scenario provokes return data and go pending.
    rules = {r.alert: r for r in artifacts.alert_rules()}
    assert set(rules) == set(EXPECTED_ALERTS) | set(QUIET_HERE)
    for alert, labels in EXPECTED_ALERTS.items():
        result = prom.query(rules[alert].expr)
        assert any(labels.items() <= r["metric"].items() for r in result), (alert, result)
    for alert in QUIET_HERE:
        assert prom.query(rules[alert].expr) == [], f"{alert} fires in a healthy scenario"
    deadline = time.monotonic() + 30
    while True:
        active = {
            a["labels"]["alertname"]
            for a in httpx.get(f"{prom.url}/api/v1/alerts").json()["data"]["alerts"]
        }
        if set(EXPECTED_ALERTS) <= active:
            break
        assert time.monotonic() < deadline, f"alerts not pending: {set(EXPECTED_ALERTS) - active}"
        time.sleep(0.5)
    assert not active & set(QUIET_HERE), active
