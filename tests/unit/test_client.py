"""refit_operator.client without a cluster: the document it builds, how it reads verdicts."""

from __future__ import annotations

import pytest
from refit_operator import api
from refit_operator.client import (
    RefitError,
    RefitFailed,
    RefitTimeout,
    build_refit,
    default_name,
    parse_selector,
    pod_failures,
    reason_of,
)
from refit_operator.reasons import Problem


def test_build_refit_sets_only_what_was_asked():
    doc = build_refit(
        "refit-step-1", "/ckpt/step-1", "step-1", fleet_selector={"app": "rollout"},
        strategy="Rolling", canary=1, on_failure="Rollback", port=8001,
    )  # fmt: skip
    assert doc["apiVersion"] == "refit.rollout.dev/v1alpha1" and doc["kind"] == "WeightRefit"
    assert doc["metadata"] == {"name": "refit-step-1"}
    assert doc["spec"] == {
        "fleet": {"selector": {"matchLabels": {"app": "rollout"}, "matchExpressions": []},
                  "port": 8001},
        "checkpoint": {"path": "/ckpt/step-1", "version": "step-1"},
        "strategy": {"type": "Rolling", "canary": 1},
        "onFailure": "Rollback",
    }  # fmt: skip


def test_build_refit_rejects_a_bad_field_before_the_cluster_sees_it():
    with pytest.raises(RefitError, match=r"strategy\.type"):
        build_refit("x", "/c", "v", fleet_selector="app=a", strategy="Sideways")
    with pytest.raises(RefitError, match=r"onFailure|on_failure"):
        build_refit("x", "/c", "v", fleet_selector="app=a", on_failure="Panic")


def test_parse_selector_forms():
    assert parse_selector("app=rollout, pool==eval").match_labels == {
        "app": "rollout",
        "pool": "eval",
    }
    assert parse_selector({"a": "b"}).canonical() == "a=b"
    sel = api.LabelSelector(match_labels={"x": "y"})
    assert parse_selector(sel) is sel
    with pytest.raises(RefitError, match="not key=value"):
        parse_selector("env in (a,b)")
    with pytest.raises(RefitError, match="must not be empty"):
        parse_selector("")


def test_default_name_is_a_dns_label():
    assert default_name("Step_100.bf16") == "refit-step-100-bf16"
    assert len(default_name("v" * 100)) == 63


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
    from refit_operator.client import History

    h = History()
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
