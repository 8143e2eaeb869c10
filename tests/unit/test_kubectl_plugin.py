"""kubectl refit without a cluster: the plan it derives from the operator's own decisions,
and the tables it prints."""

from __future__ import annotations

import argparse
import json

import pytest
from refit_operator.core import api
from refit_operator.core.decision import RefitView
from refit_operator.core.podflow import ADAPTER_PROGRESS_PREFIX, PROGRESS_ANNOTATION
from refit_operator.core.views import (
    describe,
    history_rows,
    plan_batches,
    plan_report,
    table,
    track_of,
)
from refit_operator.tools.kubectl_plugin import parse_timeout
from refit_worker.contract import READINESS_GATE


def pod(name: str, *, gate: bool = True, running: bool = True, progress: dict | None = None,
        ready: bool = False) -> dict:  # fmt: skip
    meta: dict = {"name": name}
    if progress is not None:
        meta["annotations"] = {PROGRESS_ANNOTATION: json.dumps(progress)}
    return {
        "metadata": meta,
        "spec": {"readinessGates": [{"conditionType": READINESS_GATE}] if gate else []},
        "status": {
            "phase": "Running" if running else "Pending",
            "podIP": "127.0.0.2" if running else "",
            "conditions": [{"type": READINESS_GATE, "status": "True" if ready else "False"}],
        },
    }


def refit_doc(version: str = "v2", **spec: object) -> dict:
    return {
        "metadata": {"name": "wr", "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"fleet": {"selector": {"matchLabels": {"app": "r"}}},
                 "checkpoint": {"path": "/c/" + version, "version": version}, **spec},
    }  # fmt: skip


def view(doc: dict) -> RefitView:
    spec = api.WeightRefitSpec.model_validate(doc["spec"])
    return RefitView("wr", "u1", 1, "2026-01-01T00:00:00Z", spec, api.WeightRefitStatus())


def views(*docs: dict) -> list:
    from refit_operator.core.podview import PodView

    return [PodView.from_pod(d) for d in docs]


def test_rolling_plan_with_canary_and_width():
    doc = refit_doc(strategy={"type": "Rolling", "maxUnavailable": 2, "canary": 1})
    active, batches, done = plan_batches(view(doc), views(*(pod(f"p{i}") for i in range(5))))
    assert (active, done) == ([], [])
    assert batches == [["p0"], ["p1", "p2"], ["p3", "p4"]]


def test_all_at_once_plan_skips_pods_already_verified_at_the_version():
    at_v2 = {"refit": "old", "uid": "u0", "version": "v2", "path": "/c/v2", "outcome": "Succeeded",
             "step": "", "probe": {"verdict": "Pass"}}  # fmt: skip
    in_flight = {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c/v2", "step": "load"}
    pods = views(pod("a", progress=at_v2, ready=True), pod("b", progress=in_flight), pod("c"))
    active, batches, done = plan_batches(view(refit_doc()), pods)
    assert (active, batches, done) == (["b"], [["c"]], ["a"])


def test_plan_report_names_preflight_problems_and_the_queue():
    doc = refit_doc(strategy={"type": "AllAtOnce", "canary": 1})
    ahead = {
        "metadata": {"name": "older", "creationTimestamp": "2025-12-31T00:00:00Z"},
        "spec": {"checkpoint": {"version": "v1"}},
        "status": {"phase": "Progressing"},
    }
    text = plan_report(doc, [pod("a"), pod("b", gate=False), pod("c", running=False)], [ahead])
    assert "batch 1 (canary: must pass before the rest)  a" in text
    assert "batch 2" in text and "b, c" in text
    assert "Queue: waits behind 1 refit(s) of this fleet (older)" in text
    assert "b: no readiness gate" in text and "MissingReadinessGate" in text
    assert "c: not Running" in text
    assert "NoPodsSelected" in plan_report(doc, [], [])


def test_describe_shows_each_pods_step_version_and_probe():
    doc = refit_doc()
    doc["metadata"]["namespace"] = "ns"
    doc["status"] = {
        "phase": "Halted", "updatedPods": 1, "targetPods": 2, "failedPods": 1,
        "message": "halted: 1 pods failed",
        "conditions": [{"type": "Degraded", "status": "True", "reason": "FailureLimitExceeded",
                        "message": "halted: 1 pods failed"}],
        "pods": [
            {"name": "a", "phase": "Succeeded", "step": "ready", "version": "v2",
             "probe": {"verdict": "Pass", "nll": 2.5, "referenceNll": 2.5,
                       "meanAbsLogprobDiff": 1e-6, "maxAbsLogprobDiff": 3e-6}},
            {"name": "b", "phase": "Failed", "step": "probe", "reason": "NllDrift",
             "probe": {"verdict": "Fail", "nll": 3.0, "referenceNll": 2.5}},
        ],
    }  # fmt: skip
    text = describe(doc, [pod("a", ready=True), pod("b"), pod("c")])
    lines = text.splitlines()
    assert "Phase: Halted   Updated: 1/2   Failed: 1" in lines[1]
    assert "Reason: FailureLimitExceeded" in text
    row = {line.split()[0]: line.split() for line in lines if line[:2] in ("a ", "b ", "c ")}
    assert row["a"][:8] == ["a", "Succeeded", "ready", "v2", "yes", "0", "Pass", "2.5000"]
    assert row["b"][1:3] == ["Failed", "probe"] and row["b"][-1] == "NllDrift"
    assert row["c"][1] == "Pending"


def test_history_marks_the_fleets_target_and_durations():
    def d(name: str, created: str, phase: str, took: int) -> dict:
        return {"metadata": {"name": name, "creationTimestamp": created},
                "spec": {"checkpoint": {"version": name.upper()}},
                "status": {"phase": phase, "updatedPods": 3, "targetPods": 3,
                           "startTime": "2026-01-01T00:00:00Z",
                           "completionTime": f"2026-01-01T00:00:{took:02d}Z"}}  # fmt: skip

    rows = history_rows([d("v1", "2026-01-01T00:00:00Z", "Succeeded", 5),
                         d("v2", "2026-01-01T00:01:00Z", "Succeeded", 7),
                         d("v3", "2026-01-01T00:02:00Z", "RolledBack", 30)])  # fmt: skip
    assert [r[0] for r in rows] == ["  v1", "* v2", "  v3"]
    assert [r[-1] for r in rows] == ["5s", "7s", "30s"]


def test_table_and_timeouts():
    assert table(("A", "LONGER"), [["xx", 1]]) == "A   LONGER\nxx  1"
    assert parse_timeout("90") == 90 and parse_timeout("10m") == 600
    assert parse_timeout("1h30m") == 5400 and parse_timeout("2.5s") == 2.5
    for bad in ("", "ten", "0s", "5d"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_timeout(bad)


def test_describe_shows_pods_the_status_does_not_list_from_their_records():
    """status.pods lists only pods that need attention: a pod that succeeded is shown from its
    progress annotation, with its version and probe."""
    doc = refit_doc()
    doc["metadata"]["namespace"] = "ns"
    doc["status"] = {
        "phase": "Halted", "updatedPods": 1, "targetPods": 2, "failedPods": 1,
        "pods": [{"name": "b", "phase": "Failed", "step": "checksum",
                  "reason": "WeightChecksumMismatch", "checksum": "9" * 32}],
        "checksums": [{"version": "v2", "layout": "0123456789ab", "digest": "5" * 32}],
    }  # fmt: skip
    passed = {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c/v2", "step": "",
              "outcome": "Succeeded", "attempts": 1, "step_seconds": {"load": 1.5},
              "layout": "0123456789ab", "checksum": "5" * 32,
              "probe": {"verdict": "Pass", "nll": 2.5, "referenceNll": 2.5, "tokens": 64,
                        "meanAbsLogprobDiff": 1e-6, "maxAbsLogprobDiff": 3e-6}}  # fmt: skip
    other = {**passed, "refit": "older", "uid": "u0", "version": "v1"}
    pods = [pod("a", progress=passed, ready=True), pod("b"), pod("c", progress=other)]
    text = describe(doc, pods)
    lines = text.splitlines()
    row = {line.split()[0]: line.split() for line in lines if line[:2] in ("a ", "b ", "c ")}
    assert row["a"] == ["a", "Succeeded", "ready", "v2", "yes", "1", "Pass", "2.5000", "2.5000",
                        "0.0000", "0.0000", "5" * 12, "-"]  # fmt: skip
    # The read-back checksum per pod, and the one the refit recorded for its version.
    assert row["b"][1] == "Failed" and row["b"][-1] == "WeightChecksumMismatch"
    assert "9" * 12 in row["b"]
    assert f"Checksums: v2 (0123456789ab): {'5' * 12}" in text
    assert row["c"][1:4] == ["Pending", "-", "-"]  # another refit's record: not this refit's
    assert "1 pod(s) shown Pending carry another refit's record now (older)" in text


def test_describe_headlines_the_time_out_of_traffic_and_shows_it_per_pod():
    """The summary line from status.outOfTraffic; per pod the seconds from its record (or
    the status entry), "-" for a pod not put back into traffic."""
    doc = refit_doc()
    doc["metadata"]["namespace"] = "ns"
    doc["status"] = {
        "phase": "Halted", "updatedPods": 2, "targetPods": 3, "failedPods": 1,
        "outOfTraffic": {"pods": 2, "worstSeconds": 131.5, "medianSeconds": 70.25,
                         "worstPod": "b"},
        "pods": [{"name": "c", "phase": "Failed", "step": "probe", "reason": "NllDrift"}],
    }  # fmt: skip
    passed = {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c/v2", "step": "",
              "outcome": "Succeeded", "started": 100.0, "left_traffic": 100.0,
              "finished": 109.0}  # fmt: skip
    slow = {**passed, "left_traffic": 100.0, "finished": 231.5}
    left_out = {**passed, "outcome": "Failed", "step": "probe", "reason": "NllDrift"}
    pods = [pod("a", progress=passed, ready=True), pod("b", progress=slow, ready=True),
            pod("c", progress=left_out)]  # fmt: skip
    text = describe(doc, pods)
    lines = text.splitlines()
    assert lines[2] == "Out of traffic: worst 2m11s (b), median 70.2s over 2 pod(s) put back"
    header = next(line for line in lines if line.startswith("POD "))
    assert header.split()[-2:] == ["OUT-OF-TRAFFIC", "REASON"]
    row = {line.split()[0]: line.split() for line in lines if line[:2] in ("a ", "b ", "c ")}
    assert row["a"][-1] == "9.00s" and row["b"][-1] == "2m11s"
    assert row["c"][-2:] == ["-", "NllDrift"]  # failed: still out of traffic, no figure


def test_out_of_traffic_from_the_pods_records_when_the_status_has_none():
    """An operator older than status.outOfTraffic: the summary comes from the pods' records
    of this refit (another refit's record is not counted)."""
    from refit_operator.core.views import out_of_traffic

    doc = refit_doc()
    doc["metadata"]["namespace"] = "ns"
    doc["status"] = {"phase": "Succeeded", "updatedPods": 2, "targetPods": 2}
    passed = {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c/v2", "step": "",
              "outcome": "Succeeded", "left_traffic": 100.0, "finished": 100.4}  # fmt: skip
    other = {**passed, "uid": "u0", "finished": 900.0}
    pods = [pod("a", progress=passed, ready=True), pod("z", progress=other, ready=True)]
    got = out_of_traffic(doc, pods)
    assert (got.pods, got.worst_pod, got.worst_seconds) == (1, "a", 0.4)
    assert "Out of traffic: worst 0.40s (a), median 0.40s over 1 pod(s) put back" in describe(
        doc, pods
    )
    # Nothing measured yet: no line.
    assert "Out of traffic" not in describe(doc, [pod("a"), pod("z", progress=other)])


def broadcast_doc(version: str = "v9") -> dict:
    doc = refit_doc()
    del doc["spec"]["checkpoint"]
    doc["spec"]["broadcast"] = {
        "version": version,
        "rendezvous": {"host": "10.0.0.5", "port": 29500},
        "manifest": {"configMapRef": {"name": "m"}, "digest": "ab" * 32},
    }
    doc["spec"]["probe"] = {"reference": {"source": "ConfigMap", "configMapRef": {"name": "m"}}}
    doc["metadata"]["namespace"] = "ns"
    return doc


def test_every_view_names_a_broadcast_refits_version_and_source():
    doc = broadcast_doc()
    assert describe(doc, [pod("a")]).splitlines()[0].startswith("WeightRefit ns/wr: v9 ")
    assert "v9" in " ".join(" ".join(map(str, r)) for r in history_rows([doc]))
    text = plan_report(doc, [pod("a")], [])
    assert "v9 from a refit-gloo broadcast by the trainer at 10.0.0.5:29500" in text


def test_status_and_plan_show_a_pod_group_as_one_unit_named_by_its_leader():
    """With spec.fleet.groups, `kubectl refit status` and `plan` count groups as the operator
    does: a follower (no record of its own) is no row of its own, and the group's gate is
    "yes" only when every pod of it is in traffic."""
    from refit_operator.core.api import LWS_GROUP_LABEL, LWS_INDEX_LABEL
    from refit_operator.core.views import pod_rows

    doc = refit_doc(strategy={"type": "Rolling", "maxUnavailable": 1})
    doc["spec"]["fleet"]["groups"] = {}
    passed = {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c/v2", "outcome": "Succeeded",
              "step": "", "probe": {"verdict": "Pass"}}  # fmt: skip
    pods = []
    for key in ("g1", "g2"):
        for index in (0, 1):
            p = pod(f"{key}-{index}", ready=True,
                    progress=passed if key == "g1" and index == 0 else None)  # fmt: skip
            p["metadata"]["labels"] = {LWS_GROUP_LABEL: key, LWS_INDEX_LABEL: str(index)}
            pods.append(p)
    pods[1]["status"]["conditions"][0]["status"] = "False"  # g1's follower out of traffic
    rows = {str(r[0]): r for r in pod_rows(doc, pods)}
    assert sorted(rows) == ["g1-0", "g2-0"]
    assert (rows["g1-0"][1], rows["g1-0"][4]) == ("Succeeded", "no")
    assert rows["g2-0"][4] == "yes"
    text = plan_report(doc, pods, [])
    assert "g1-1" not in text and "g2-1" not in text


def test_an_adapter_refit_is_shown_from_the_adapter_records():
    """A pod carries the base weights' record and an adapter's (spec.adapter): an adapter
    refit's describe and plan read the adapter's, never the base weights'."""
    doc = refit_doc()
    del doc["spec"]["checkpoint"]
    doc["spec"]["adapter"] = {"name": "policy", "path": "/lora/s2", "version": "s2"}
    doc["metadata"]["namespace"] = "ns"
    doc["status"] = {"phase": "Succeeded", "updatedPods": 1, "targetPods": 1}
    probe = {"verdict": "Pass", "nll": 2.5, "referenceNll": 2.5, "tokens": 64,
             "meanAbsLogprobDiff": 1e-6, "maxAbsLogprobDiff": 3e-6}  # fmt: skip
    base = {"refit": "base-v9", "uid": "u0", "version": "v9", "path": "/c/v9", "step": "",
            "outcome": "Succeeded", "probe": probe}  # fmt: skip
    lora = {"refit": "wr", "uid": "u1", "version": "s2", "path": "/lora/s2", "step": "",
            "outcome": "Succeeded", "source": "adapter", "adapter": "policy",
            "probe": probe}  # fmt: skip
    p = pod("p0", ready=True, progress=base)
    p["metadata"]["annotations"][ADAPTER_PROGRESS_PREFIX + "policy"] = json.dumps(lora)
    row = next(line for line in describe(doc, [p]).splitlines() if line.startswith("p0"))
    assert " s2 " in row and "v9" not in row, row
    assert (track_of(doc), track_of(refit_doc())) == ("policy", "")
    report = plan_report(doc, [p], [doc])
    assert "LoRA adapter 'policy' at /lora/s2" in report and "p0" in report
