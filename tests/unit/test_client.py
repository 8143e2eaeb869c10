"""refit_client.client without a cluster: how it reads verdicts."""

from __future__ import annotations

from refit_client.client import RefitFailed, RefitTimeout, WatchedFailures, pod_failures
from refit_client.kubectl_text import reason_of
from refit_operator.core.reasons import Problem

HALTED = {
    "phase": "Halted",
    "message": "halted: 1 pods failed (failureLimit 0)",
    "conditions": [
        {"type": "Ready", "status": "False", "reason": "FailureLimitExceeded", "message": "m"},
        {"type": "Progressing", "status": "False", "reason": "Halted", "message": "m"},
        {"type": "Degraded", "status": "True", "reason": "FailureLimitExceeded",
         "message": "halted: 1 pods failed (failureLimit 0)"},
    ],
    "pods": [
        {"name": "pod-0", "phase": "Succeeded", "version": "v3"},
        {"name": "pod-1", "phase": "Failed", "reason": "NllDrift", "message": "NLL 3.1 vs 2.0"},
    ],
}  # fmt: skip


def test_refit_failed_carries_the_operators_reason_and_the_pods():
    e = RefitFailed("wr", HALTED)
    assert (e.phase, e.reason) == ("Halted", "FailureLimitExceeded")
    assert e.message == "halted: 1 pods failed (failureLimit 0)"
    assert [(f.pod, f.reason) for f in e.pod_failures] == [("pod-1", "NllDrift")]
    assert "pod-1: Failed NllDrift: NLL 3.1 vs 2.0" in str(e)


def test_reason_of_superseded_comes_from_ready():
    st = {
        "phase": "Superseded",
        "message": "superseded by b (LatestWins)",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "Superseded", "message": "by b"},
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""},
        ],
    }
    assert reason_of(st) == Problem("Superseded", "by b")
    assert reason_of({"phase": "Failed", "message": "x"}) == Problem("Failed", "x")
    assert pod_failures({}) == []


def test_timeout_message_says_where_it_stands():
    e = RefitTimeout("wr", 5, {"phase": "Progressing", "updatedPods": 1, "targetPods": 3})
    assert isinstance(e, TimeoutError)
    assert "not finished after 5s: phase Progressing, 1/3 pods updated" in str(e)


def test_a_rollback_keeps_the_cause_seen_before_it():
    h = WatchedFailures()
    rolling = {**HALTED, "phase": "RollingBack"}
    h.observe(rolling)
    rolled = {"phase": "RolledBack", "message": "2 pods rolled back to v2",
              "conditions": [{"type": "Degraded", "status": "True", "reason": "RolledBack",
                              "message": "2 pods rolled back to v2"}],
              "pods": [{"name": "pod-0", "phase": "RolledBack", "version": "v2"},
                       {"name": "pod-1", "phase": "RolledBack", "version": "v2"}]}  # fmt: skip
    h.observe(rolled)
    e = h.failed("wr", rolled)
    assert (e.phase, e.reason, e.cause) == ("RolledBack", "RolledBack", "FailureLimitExceeded")
    assert [(f.pod, f.reason) for f in e.pod_failures] == [("pod-1", "NllDrift")]
    assert "RolledBack (after FailureLimitExceeded)" in str(e)
