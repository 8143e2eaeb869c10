"""API writes per pod are a small constant, and the WeightRefit status is not written once
per pod event: measured on the API server's own request counters with a 100-pod fleet. The
status stays small: a Succeeded refit lists no pod, and every pod carries its own record."""

from __future__ import annotations

import json
import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.fleet import make_checkpoints, start_fleet

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

# REFIT_SCALE_PODS=1000 runs the benchmark size.
PODS = int(os.environ.get("REFIT_SCALE_PODS", "100"))


def write_counts(control_plane) -> dict[tuple[str, str], float]:
    """PATCH and POST requests by (resource, subresource) since the API server started."""
    text = control_plane.kubectl("get", "--raw", "/metrics").stdout
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if s.name == "apiserver_request_total" and s.labels.get("verb") in ("PATCH", "POST"):
                key = (s.labels.get("resource", ""), s.labels.get("subresource", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_writes_per_pod_are_constant(harness, sim_fleet, tmp_path, control_plane):
    fleet, op = harness
    sims = start_fleet(fleet, sim_fleet, tmp_path, PODS)
    ckpt = make_checkpoints(tmp_path, "v1")
    op.start()
    before = write_counts(control_plane)
    started = time.monotonic()
    fleet.apply_refit("wr", "v1", ckpt["v1"], sims[0].port)
    st = fleet.wait_phase("wr", {"Succeeded", "Failed", "Halted"}, 400, op)["status"]
    seconds = time.monotonic() - started
    after = write_counts(control_plane)
    assert st["phase"] == "Succeeded" and st["updatedPods"] == PODS

    def delta(resource: str, sub: str) -> float:
        return after.get((resource, sub), 0.0) - before.get((resource, sub), 0.0)

    pod_patches = delta("pods", "")
    records = delta("pods", "status")
    events = delta("events", "")
    status = delta("weightrefits", "status")
    per_pod = f"{records / PODS:.1f} records, {events / PODS:.1f} Events"
    print(f"\n{PODS} pods in {seconds:.1f}s: {per_pod} per pod, {status:.0f} status writes")
    # Every pod write is a pods/status patch, at the pass's checkpoints only: start (out of
    # traffic), weights loaded, end (back in traffic); not one per step.
    assert pod_patches == 0
    assert records <= PODS * 3
    assert events <= PODS + 10  # one per pod; a few for the refit's own transitions
    # Status writes follow reconcile ticks, not pod events (a pod passes ~10 steps).
    assert status < PODS

    # No pod needs attention: the status lists none (it stays small at any fleet size), the
    # probe summary counts every pod, and each pod's full record is its progress annotation.
    doc = fleet.refit("wr")
    assert doc["status"]["pods"] == [] and doc["status"]["podsOmitted"] == 0
    assert doc["status"]["probeSummary"]["passed"] == PODS
    assert len(json.dumps(doc["status"])) < 4096
    annotations = [fleet.progress(p) for p in fleet.pods()]
    assert len(annotations) == PODS
    for r in annotations:
        assert r is not None and r["uid"] == doc["metadata"]["uid"], r
        assert (r["outcome"], r["version"], r["probe"]["verdict"]) == ("Succeeded", "v1", "Pass")
        assert set(r["step_seconds"]) >= {"drain", "load", "probe", "ready"}
