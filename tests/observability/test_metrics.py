"""The operator's metrics: naming, bounded labels, series lifecycle, documentation."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from refit_operator.edges import metrics as metrics_module
from refit_operator.edges.metrics import POD_PHASES, Metrics

from testbed.controlplane import free_port
from tests.observability import artifacts, driver

ALLOWED_LABELS = {"namespace", "fleet", "refit", "pod", "step", "result", "phase", "kind", "verb"}
NAME = re.compile(r"^refit_[a-z][a-z0-9]*(_[a-z0-9]+)*$")
UNIT_SUFFIXES = ("_seconds", "_nats", "_total", "_info")


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    return {m.name: m for m in registry.collect()}


def driven() -> Metrics:
    m = Metrics(CollectorRegistry())
    driver.run_all(m, time.time())
    return m


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    value = m.registry.get_sample_value(name, labels)
    return value


def test_every_metric_follows_prometheus_naming() -> None:
    fams = families(driven().registry)
    assert len(fams) >= 20
    for name, fam in fams.items():
        exposed = f"{name}_total" if fam.type == "counter" else name
        assert NAME.match(exposed), f"{exposed}: not refit_-prefixed snake_case"
        assert ":" not in exposed, f"{exposed}: colons are for recording rules"
        if fam.type == "counter":
            assert exposed.endswith("_total")
        elif exposed.endswith("_total"):
            pytest.fail(f"{exposed}: only counters end in _total")
        if fam.type == "histogram":
            assert name.endswith("_seconds"), f"{name}: histograms here measure seconds"
        if exposed.endswith("_info"):
            assert fam.type in ("gauge", "info")
        if "timestamp" in name or "time" in name.split("_"):
            assert name.endswith("_seconds"), f"{name}: times are in seconds"
        assert fam.documentation, f"{name}: no HELP text"
        # Probe values carry their unit; pod counts are plain counts.
        if (
            name.startswith("refit_probe_")
            and fam.type == "gauge"
            and name != "refit_probe_verdict"
        ):
            assert name.endswith(UNIT_SUFFIXES), name


def test_labels_are_bounded() -> None:
    for name, fam in families(driven().registry).items():
        for s in fam.samples:
            labels = set(s.labels) - {"le"}
            if name.endswith("_info"):
                # An info series carries what it describes: a version, or a pod's read-back
                # (one series per pod, replaced by the next read-back).
                extra = labels - ALLOWED_LABELS
                assert extra in ({"version"}, {"layout", "checksum"}), f"{name}: {labels}"
            else:
                assert labels <= ALLOWED_LABELS, (
                    f"{name}: unbounded labels {labels - ALLOWED_LABELS}"
                )
                assert "version" not in labels


def test_enum_labels_are_normalised_and_checked() -> None:
    m = Metrics(CollectorRegistry())
    m.step_finished("rl", "app=a", "wakeKV", "success", 0.5)
    assert (
        sample(
            m,
            "refit_step_duration_seconds_count",
            namespace="rl",
            fleet="app=a",
            step="wake_kv",
            result="success",
        )
        == 1
    )
    # Outside the per-pod sequence: a refused load puts the pod back on its weights (runner).
    m.step_finished("rl", "app=a", "restore", "success", 0.2)
    with pytest.raises(ValueError, match="unknown step 'warmup'"):
        m.step_finished("rl", "app=a", "warmup", "success", 0.5)
    with pytest.raises(ValueError, match="unknown step result 'ok'"):
        m.step_finished("rl", "app=a", "load", "ok", 0.5)
    with pytest.raises(ValueError, match=">= 0 seconds"):
        m.step_finished("rl", "app=a", "load", "success", -1)
    with pytest.raises(ValueError, match="unknown verdict"):
        m.probe_result("rl", "app=a", "r", "p", "Maybe", 1, 1, 0, 0)
    with pytest.raises(ValueError, match="unknown refit result"):
        m.refit_finished("rl", "app=a", "Exploded")
    with pytest.raises(ValueError, match="unknown pod phase"):
        m.fleet_state(
            "rl",
            "app=a",
            "r",
            pods_by_phase={"Sleeping": 1},
            out_of_traffic=0,
            version_skew=0,
            target_version="v",
        )
    # The bad calls recorded nothing; a fleet seen only in bad calls has no series at all.
    assert (
        sample(m, "refit_probe_verdicts_total", namespace="rl", fleet="app=a", result="pass") == 0
    )
    with pytest.raises(ValueError):
        m.step_finished("rl", "app=new", "warmup", "success", 0.5)
    assert not [
        s for f in m.registry.collect() for s in f.samples if s.labels.get("fleet") == "app=new"
    ]
    # Failure-path enums never raise: unknown values count as "other".
    m.reconcile_error("KeyboardTrouble")
    m.api_retry("PATCH")
    assert sample(m, "refit_operator_reconcile_errors_total", kind="other") == 1
    assert sample(m, "refit_operator_api_retries_total", verb="patch") == 1


def test_a_newer_refit_replaces_the_pods_probe_series() -> None:
    m = Metrics(CollectorRegistry())
    m.probe_result("rl", "app=a", "r1", "p0", "Fail", 2.5, 2.0, 0.3, 1.2)
    m.probe_result("rl", "app=a", "r2", "p0", "Pass", 2.0, 2.0, 0.01, 0.04)
    assert (
        sample(m, "refit_probe_nll_nats", namespace="rl", fleet="app=a", refit="r1", pod="p0")
        is None
    )
    assert (
        sample(
            m,
            "refit_probe_verdict",
            namespace="rl",
            fleet="app=a",
            refit="r1",
            pod="p0",
            result="fail",
        )
        is None
    )
    labels = {"namespace": "rl", "fleet": "app=a", "refit": "r2", "pod": "p0"}
    assert sample(m, "refit_probe_logprob_abs_diff_max_nats", **labels) == 0.04
    assert sample(m, "refit_probe_verdict", **labels, result="pass") == 1
    assert sample(m, "refit_probe_verdict", **labels, result="fail") == 0
    # The counter keeps both verdicts.
    assert (
        sample(m, "refit_probe_verdicts_total", namespace="rl", fleet="app=a", result="fail") == 1
    )
    # An inconclusive probe has no values: the gauges go absent rather than stale.
    m.probe_result("rl", "app=a", "r2", "p0", "Inconclusive", None, 2.0, None, None)
    assert sample(m, "refit_probe_nll_nats", **labels) is None
    assert sample(m, "refit_probe_reference_nll_nats", **labels) == 2.0
    m.probe_result("rl", "app=a", "r2", "p0", "Fail", float("nan"), 2.0, float("inf"), 3.0)
    assert sample(m, "refit_probe_nll_nats", **labels) is None
    assert sample(m, "refit_probe_logprob_abs_diff_mean_nats", **labels) is None
    assert sample(m, "refit_probe_logprob_abs_diff_max_nats", **labels) == 3.0
    m.forget_pod("rl", "app=a", "p0")
    assert sample(m, "refit_probe_reference_nll_nats", **labels) is None
    assert sample(m, "refit_probe_verdict", **labels, result="inconclusive") is None


def test_fleet_state_follows_the_current_refit() -> None:
    m = Metrics(CollectorRegistry())
    m.probe_thresholds("rl", "app=a", "r1", mean_abs_diff=0.05, max_abs_diff=0.5, nll_diff=0.05)
    m.fleet_state(
        "rl",
        "app=a",
        "r1",
        pods_by_phase={"InProgress": 2, "Succeeded": 1},
        out_of_traffic=2,
        version_skew=2,
        target_version="v1",
        started_at=100.0,
        timeout_seconds=3600,
    )
    fleet = {"namespace": "rl", "fleet": "app=a"}
    assert sample(m, "refit_pods", **fleet, refit="r1", phase="in_progress") == 2
    assert sample(m, "refit_pods", **fleet, refit="r1", phase="failed") == 0
    assert {p for p in POD_PHASES} == {
        s.labels["phase"] for s in families(m.registry)["refit_pods"].samples
    }
    assert sample(m, "refit_active_refit_timeout_seconds", **fleet, refit="r1") == 3600
    m.refit_finished("rl", "app=a", "Succeeded")
    assert sample(m, "refit_refits_total", **fleet, result="succeeded") == 1
    assert sample(m, "refit_active_refit_start_time_seconds", **fleet, refit="r1") is None
    assert sample(m, "refit_fleet_target_version_info", **fleet, refit="r1", version="v1") == 1
    m.fleet_state(
        "rl",
        "app=a",
        "r2",
        pods_by_phase={"Pending": 3},
        out_of_traffic=0,
        version_skew=3,
        target_version="v2",
    )
    assert sample(m, "refit_fleet_target_version_info", **fleet, refit="r1", version="v1") is None
    assert sample(m, "refit_fleet_target_version_info", **fleet, refit="r2", version="v2") == 1
    assert sample(m, "refit_pods", **fleet, refit="r1", phase="in_progress") is None
    assert sample(m, "refit_probe_threshold_nll_diff_nats", **fleet, refit="r1") is None
    assert sample(m, "refit_fleet_version_skew", **fleet) == 3
    m.fleet_state(
        "rl",
        "app=a",
        "r2",
        pods_by_phase={"Pending": 3},
        out_of_traffic=0,
        version_skew=3,
        target_version="v2",
        started_at=200.0,
        timeout_seconds=60,
    )
    # Ending a named refit drops that refit's active series.
    m.refit_finished("rl", "app=a", "Failed", refit="r2")
    assert sample(m, "refit_active_refit_start_time_seconds", **fleet, refit="r2") is None
    assert sample(m, "refit_refits_total", **fleet, result="failed") == 1
    m.forget_fleet("rl", "app=a")
    assert sample(m, "refit_fleet_version_skew", **fleet) is None
    assert sample(m, "refit_pods", **fleet, refit="r2", phase="pending") is None


def test_a_fleets_counters_start_at_zero() -> None:
    """So increase() counts a fleet's first step, verdict and outcome (rare events)."""
    m = Metrics(CollectorRegistry())
    m.fleet_state(
        "rl",
        "app=a",
        "r1",
        pods_by_phase={"Pending": 1},
        out_of_traffic=0,
        version_skew=1,
        target_version="v1",
    )
    fleet = {"namespace": "rl", "fleet": "app=a"}
    assert (
        sample(m, "refit_step_duration_seconds_count", **fleet, step="load", result="success") == 0
    )
    assert sample(m, "refit_probe_verdicts_total", **fleet, result="fail") == 0
    assert sample(m, "refit_refits_total", **fleet, result="succeeded") == 0
    m.forget_fleet("rl", "app=a")
    assert sample(m, "refit_refits_total", **fleet, result="succeeded") is None
    assert (
        sample(m, "refit_step_duration_seconds_count", **fleet, step="load", result="success")
        is None
    )


def test_reconcile_done_sets_the_heartbeat() -> None:
    m = Metrics(CollectorRegistry(), clock=lambda: 1234.5)
    assert sample(m, "refit_operator_last_successful_reconcile_timestamp_seconds") == 0
    m.reconcile_done()
    assert sample(m, "refit_operator_last_successful_reconcile_timestamp_seconds") == 1234.5
    assert sample(m, "refit_operator_reconciles_total") == 1


def test_the_doc_table_lists_exactly_the_metrics() -> None:
    exposed = set()
    for name, fam in families(driven().registry).items():
        exposed.add(f"{name}_total" if fam.type == "counter" else name)
    documented = set(
        re.findall(r"^\| `(refit_[a-z0-9_]+)` \|", artifacts.METRICS_DOC.read_text(), re.MULTILINE)
    )
    assert documented == exposed


def test_serve_exposes_the_default_registry() -> None:
    """The module-level interface the operator calls, over real HTTP."""
    port = free_port()
    metrics_module.serve(port, addr="127.0.0.1")
    metrics_module.step_finished("obs-test", "app=serve", "load", "success", 3.0)
    metrics_module.reconcile_done()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["refit_operator_last_successful_reconcile_timestamp_seconds"].samples[0].value > 0
    counts = [
        s
        for s in fams["refit_step_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels.get("fleet") == "app=serve" and s.value
    ]
    assert [(s.labels["step"], s.labels["result"], s.value) for s in counts] == [
        ("load", "success", 1.0)
    ]
    assert "process_cpu_seconds_total" in text
    assert not any(name.endswith("_created") for name in fams)


def _exposition_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_metric_in_dashboards_and_alerts_is_exposed() -> None:
    port = free_port()
    m = driven()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    try:
        exposed = _exposition_names(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    finally:
        server.shutdown()
        thread.join(5)
    used = set()
    for q in artifacts.panel_queries():
        used |= artifacts.metric_names(q.expr)
    for expr in artifacts.variable_queries():
        used |= artifacts.metric_names(expr)
    for rule in artifacts.alert_rules():
        used |= artifacts.metric_names(rule.expr)
    used.discard("up")  # Prometheus' own scrape-health series
    assert len(used) >= 15
    missing = sorted(n for n in used if n not in exposed)
    assert not missing, f"used in dashboards/alerts but not in /metrics: {missing}"
