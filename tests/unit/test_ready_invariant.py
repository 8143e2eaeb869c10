"""The test bed's invariant (testbed.fleet.ready_violation): a Ready pod serves weights a probe
passed on. It must hold for every way a pod is legitimately Ready and fail for the others."""

from __future__ import annotations

import json
from typing import Any

import pytest
from refit_operator.core.api_spec import LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_operator.core.podflow import PROGRESS_ANNOTATION
from refit_worker.contract import READINESS_GATE

from testbed.fleet import group_leader, ready_violation


def pod(ready: bool, reason: str, message: str, **record: Any) -> dict[str, Any]:
    annotations = {PROGRESS_ANNOTATION: json.dumps(record)} if record else {}
    cond = {"type": READINESS_GATE, "status": "True" if ready else "False", "reason": reason,
            "message": message}  # fmt: skip
    return {"metadata": {"name": "p", "annotations": annotations}, "status": {"conditions": [cond]}}


PROBED_V1 = ("ProbePassed", "weights v1 probed")


@pytest.mark.parametrize(
    "case",
    [
        pod(True, *PROBED_V1, outcome="Succeeded", version="v1", probe={"verdict": "Pass"}),
        # v2 staging while the pod serves v1 under the condition v1's probe wrote
        pod(True, *PROBED_V1, outcome="", version="v2", serving="v1", left_traffic=0),
        # v2 refused while staging: still serving v1, condition untouched
        pod(True, *PROBED_V1, outcome="Failed", version="v2", serving="v1", left_traffic=0),
        pod(
            True,
            "PreviousWeights",
            "serving v1 again: ...",
            outcome="Failed",
            serving="v1",
            left_traffic=5.0,
            restored=True,
        ),
        pod(False, "Refitting", "", outcome="", serving="v1", left_traffic=5.0),
        # v2 staging while the pod serves v1 under the condition an earlier pass's restore
        # wrote (seen when a GRPO run followed one whose broadcast was refused)
        pod(
            True,
            "PreviousWeights",
            "serving v1 again: v9 refused (TransferMismatch: x)",
            outcome="",
            version="v2",
            serving="v1",
            left_traffic=0,
        ),
    ],
)
def test_legitimately_ready_or_out(case: dict[str, Any]) -> None:
    assert ready_violation(case) is None


@pytest.mark.parametrize(
    "case",
    [
        pod(True, "ProbePassed", "weights v1 probed"),  # no record at all
        pod(True, *PROBED_V1, outcome="Succeeded", version="v1", probe={"verdict": "Fail"}),
        # staging, but the condition is another version's probe
        pod(True, "ProbePassed", "weights v0 probed", outcome="", serving="v1", left_traffic=0),
        # staging under a restore's condition of another version
        pod(
            True,
            "PreviousWeights",
            "serving v0 again: v9 refused (x)",
            outcome="",
            version="v2",
            serving="v1",
            left_traffic=0,
        ),
        # the pass took the pod out of traffic: Ready now is wrong
        pod(True, *PROBED_V1, outcome="", version="v2", serving="v1", left_traffic=5.0),
        # nothing served with a probe when the pass began
        pod(True, *PROBED_V1, outcome="", version="v2", serving="", left_traffic=0),
        pod(
            True,
            "PreviousWeights",
            "x",
            outcome="Failed",
            serving="v1",
            restored=False,
            left_traffic=5.0,
        ),
        # "restored" after a try of the load that may have changed the model
        pod(
            True,
            "PreviousWeights",
            "serving v1 again: ...",
            outcome="Failed",
            serving="v1",
            left_traffic=5.0,
            restored=True,
            touched=True,
        ),
    ],
)
def test_ready_without_a_passed_probe(case: dict[str, Any]) -> None:
    assert ready_violation(case) is not None


def test_a_group_follower_is_ready_only_while_its_leader_is() -> None:
    """A follower of a pod group carries no record: its leader's vouches for it
    (spec.fleet.groups), and it is Ready only while the leader is."""
    labels = {LWS_GROUP_LABEL: "g", LWS_INDEX_LABEL: "0"}
    leader = pod(True, *PROBED_V1, outcome="Succeeded", version="v1", probe={"verdict": "Pass"})
    leader["metadata"]["labels"] = labels
    follower = pod(True, *PROBED_V1)
    follower["metadata"]["labels"] = {**labels, LWS_INDEX_LABEL: "1"}
    pods = [leader, follower]
    assert group_leader(follower, pods) is leader and group_leader(leader, pods) is None
    assert ready_violation(follower, leader) is None
    assert ready_violation(follower) is not None  # no record of its own
    out = pod(False, "Refitting", "", outcome="", version="v2", serving="v1", left_traffic=5.0)
    assert "its group's leader is not" in str(ready_violation(follower, out))
    unprobed = pod(True, "ProbePassed", "weights v2 probed", outcome="", version="v2")
    assert ready_violation(follower, unprobed) is not None
