"""A realistic WeightRefit .status: a Rolling refit of 6 pods that halted on a drifting pod."""

from __future__ import annotations

from typing import Any

STEP_SECONDS = {
    "stage": 0.3,
    "drain": 1.2,
    "sleep": 0.4,
    "wakeWeights": 0.6,
    "load": 11.8,
    "wakeKV": 0.7,
    "resetCache": 0.05,
    "stampVersion": 0.1,
    "probe": 2.4,
    "ready": 0.04,
}


def _pod(i: int, start: str, end: str, **extra: Any) -> dict[str, Any]:
    seconds = {k: round(v * (1 + 0.07 * i), 3) for k, v in STEP_SECONDS.items()}
    pod: dict[str, Any] = {
        "name": f"vllm-rollout-{i}",
        "phase": "Succeeded",
        "step": "ready",
        "version": "step-1200",
        "attempts": 0,
        "startTime": start,
        "completionTime": end,
        "stepSeconds": seconds,
        "probe": {
            "verdict": "Pass",
            "nll": 2.3141 + 0.002 * i,
            "referenceNll": 2.3141,
            "meanAbsLogprobDiff": 0.006 + 0.002 * i,
            "maxAbsLogprobDiff": 0.04 + 0.015 * i,
            "tokens": 512,
        },
    }
    pod.update(extra)
    return pod


def halted_rolling_refit() -> dict[str, Any]:
    pods = [
        _pod(0, "2026-11-29T08:00:01Z", "2026-11-29T08:00:20Z"),
        _pod(1, "2026-11-29T08:00:01Z", "2026-11-29T08:00:21Z"),
        _pod(2, "2026-11-29T08:00:22Z", "2026-11-29T08:00:45Z"),
        _pod(
            3,
            "2026-11-29T08:00:22Z",
            "2026-11-29T08:00:44Z",
            phase="Failed",
            step="probe",
            reason="ProbeMismatch",
            message="max |Δlogprob| 1.84 > 0.5 on prompt 3",
            probe={
                "verdict": "Fail",
                "nll": 2.71,
                "referenceNll": 2.3141,
                "meanAbsLogprobDiff": 0.231,
                "maxAbsLogprobDiff": 1.84,
                "tokens": 512,
            },
        ),
        _pod(
            4,
            "2026-11-29T08:00:22Z",
            "2026-11-29T08:01:31Z",
            phase="Inconclusive",
            step="probe",
            attempts=2,
            reason="ProbeTimeout",
            message="probe timed out after 20s (3 attempts)",
            probe={"verdict": "Inconclusive", "referenceNll": 2.3141, "tokens": 0},
        ),
        {
            "name": "vllm-rollout-5",
            "phase": "Pending",
            "step": "",
            "version": "step-1100",
            "attempts": 0,
            "stepSeconds": {},
        },
    ]
    pods[4]["stepSeconds"].pop("ready")
    pods[3]["stepSeconds"].pop("ready")
    # The succeeded pods were out of traffic from the end of staging to the end of the pass.
    for pod in pods[:3]:
        out = sum(v for k, v in pod["stepSeconds"].items() if k != "stage")
        pod["outOfTrafficSeconds"] = round(out, 3)
    back = sorted((p["outOfTrafficSeconds"], p["name"]) for p in pods[:3])
    return {
        "phase": "Halted",
        "observedGeneration": 1,
        "message": "halted: 1 pod failed its probe (failureLimit 0); 1 inconclusive; 1 not started",
        "targetPods": 6,
        "updatedPods": 3,
        "failedPods": 1,
        "inconclusivePods": 1,
        "fleet": "app=rollout",
        "startTime": "2026-11-29T08:00:00Z",
        "completionTime": "2026-11-29T08:01:32Z",
        "probeSummary": {
            "passed": 3,
            "failed": 1,
            "inconclusive": 1,
            "worstMeanAbsLogprobDiff": 0.231,
            "worstMaxAbsLogprobDiff": 1.84,
            "worstNllDiff": 0.3959,
            "nllSpread": 0.3959,
        },
        "outOfTraffic": {
            "pods": 3,
            "worstSeconds": back[-1][0],
            "medianSeconds": back[1][0],
            "worstPod": back[-1][1],
        },
        "pods": pods,
    }
