"""metrics.forget_refit: a deleted refit leaves no series behind (garbage collection)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from refit_operator.edges import metrics
from refit_operator.edges.metrics import Metrics


def series(registry: CollectorRegistry) -> list[tuple[str, dict[str, str]]]:
    """Every sample of a scrape of the registry: (name, labels)."""
    text = generate_latest(registry).decode()
    return [(s.name, s.labels) for f in text_string_to_metric_families(text) for s in f.samples]


def labelled(registry: CollectorRegistry, refit: str) -> list[str]:
    return sorted({name for name, labels in series(registry) if labels.get("refit") == refit})


def drive(m: Metrics | None, ns: str, fleet: str, refit: str, pods: tuple[str, ...]) -> None:
    """Everything the operator records for one refit (through `m`, or the module's API)."""
    api = m if m is not None else metrics
    api.probe_thresholds(ns, fleet, refit, mean_abs_diff=0.05, max_abs_diff=0.5, nll_diff=0.05)
    for pod in pods:
        api.probe_result(ns, fleet, refit, pod, "Pass", 2.0, 2.0, 0.01, 0.04)
    api.fleet_state(
        ns,
        fleet,
        refit,
        pods_by_phase={"Succeeded": len(pods)},
        out_of_traffic=0,
        version_skew=0,
        target_version=f"v-{refit}",
        started_at=100.0,
        timeout_seconds=3600,
    )
    api.step_finished(ns, fleet, "load", "success", 1.5)
    api.pod_out_of_traffic(ns, fleet, 2.5)


def test_forget_refit_empties_the_scrape_of_the_module_registry() -> None:
    """Through the module-level interface the operator calls, on the registry /metrics serves."""
    ns, fleet = "gc-unit", "app=gc-unit"
    drive(None, ns, fleet, "gc-step-1", ("gc-p0", "gc-p1"))
    registry = metrics.METRICS.registry
    before = labelled(registry, "gc-step-1")
    assert "refit_probe_nll_nats" in before and "refit_pods" in before
    assert "refit_fleet_target_version_info" in before

    metrics.forget_refit(ns, fleet, "gc-step-1")

    assert labelled(registry, "gc-step-1") == []
    # Per-fleet series carry no refit and stay: outcome counts survive garbage collection.
    fleet_series = {name for name, labels in series(registry) if labels.get("fleet") == fleet}
    assert "refit_step_duration_seconds_count" in fleet_series
    assert "refit_pod_out_of_traffic_seconds_count" in fleet_series
    assert "refit_fleet_version_skew" in fleet_series
    metrics.forget_fleet(ns, fleet)


def test_forget_refit_leaves_other_refits_and_fleets_alone() -> None:
    m = Metrics(CollectorRegistry())
    drive(m, "rl", "app=a", "step-1", ("p0", "p1"))
    drive(m, "rl", "app=a", "step-2", ("p1",))  # p1 moved on to step-2; p0 still shows step-1
    drive(m, "rl", "app=b", "step-1", ("q0",))  # same name, another fleet
    assert labelled(m.registry, "step-1")

    m.forget_refit("rl", "app=a", "step-1")

    names_a = {
        name
        for name, labels in series(m.registry)
        if labels.get("fleet") == "app=a" and labels.get("refit") == "step-1"
    }
    assert names_a == set()
    kept = {
        (labels.get("fleet"), labels.get("refit"), labels.get("pod"))
        for name, labels in series(m.registry)
        if name == "refit_probe_nll_nats"
    }
    assert kept == {("app=a", "step-2", "p1"), ("app=b", "step-1", "q0")}
    # The fleet's current refit (step-2) keeps its target-version info.
    assert m.registry.get_sample_value(
        "refit_fleet_target_version_info",
        {"namespace": "rl", "fleet": "app=a", "refit": "step-2", "version": "v-step-2"},
    )
    # Forgetting the fleet's current refit drops its info series too; a later refit sets it.
    m.forget_refit("rl", "app=a", "step-2")
    assert labelled(m.registry, "step-2") == []
    drive(m, "rl", "app=a", "step-3", ("p0",))
    assert "refit_fleet_target_version_info" in labelled(m.registry, "step-3")
    # Forgetting twice, or a refit never seen, is a no-op.
    m.forget_refit("rl", "app=a", "step-2")
    m.forget_refit("rl", "app=zzz", "never")


def test_forget_fleet_drops_the_time_out_of_traffic_histogram() -> None:
    """The histogram exists at 0 from a fleet's first call (so rate() sees its first
    observation), counts each pod put back into traffic, and goes with the fleet."""
    m = Metrics(CollectorRegistry())
    drive(m, "rl", "app=a", "step-1", ("p0",))
    drive(m, "rl", "app=b", "step-1", ("q0",))
    m.pod_out_of_traffic("rl", "app=a", 400.0)
    fleet_a = {"namespace": "rl", "fleet": "app=a"}
    count = "refit_pod_out_of_traffic_seconds_count"
    assert m.registry.get_sample_value(count, fleet_a) == 2
    assert (
        m.registry.get_sample_value(
            "refit_pod_out_of_traffic_seconds_bucket", {**fleet_a, "le": "300.0"}
        )
        == 1
    )  # the 2.5 s pass; the 400 s one is above the alert's threshold

    m.forget_fleet("rl", "app=a")

    assert not [n for n, labels in series(m.registry) if labels.get("fleet") == "app=a"]
    assert m.registry.get_sample_value(count, {"namespace": "rl", "fleet": "app=b"}) == 1
    # A fleet seen again starts at 0.
    m.fleet_state("rl", "app=a", "step-2", pods_by_phase={}, out_of_traffic=0, version_skew=0,
                  target_version="v")  # fmt: skip
    assert m.registry.get_sample_value(count, fleet_a) == 0


def test_time_out_of_traffic_is_validated() -> None:
    m = Metrics(CollectorRegistry())
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="out of traffic"):
            m.pod_out_of_traffic("rl", "app=a", bad)
    with pytest.raises(ValueError, match="fleet"):
        m.pod_out_of_traffic("rl", "", 1.0)
    # The bad calls recorded nothing, not even the fleet's zeroed series.
    assert not [n for n, labels in series(m.registry) if labels.get("namespace") == "rl"]


def test_a_pods_read_back_checksum_is_one_series_replaced_and_forgotten() -> None:
    m = Metrics(CollectorRegistry())
    m.pod_checksum("rl", "app=a", "p0", "L1", "d1")
    m.pod_checksum("rl", "app=a", "p0", "L1", "d2")  # the next load's read-back replaces it
    m.pod_checksum("rl", "app=a", "p1", "L1", "d2")
    got = sorted(
        (labels["pod"], labels["checksum"])
        for name, labels in series(m.registry)
        if name == "refit_pod_weights_checksum_info"
    )
    assert got == [("p0", "d2"), ("p1", "d2")]
    m.forget_pod("rl", "app=a", "p0")
    m.forget_fleet("rl", "app=a")
    assert not [n for n, _ in series(m.registry) if n == "refit_pod_weights_checksum_info"]
