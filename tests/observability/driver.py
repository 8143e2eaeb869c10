"""A realistic sequence of operator metric calls, for when the real operator is not the source.

Three fleets in namespace `rl`, each ending in a state one alert is about:
  app=rollout  refit step-100: four pods refitted, vllm-3's probe fails (checkpoint drift), the
               refit halts with that pod out of traffic          -> RefitProbeFailing,
                                                                     RefitPodsOutOfTraffic
  app=eval     refit step-7: one pod's load times out, the refit halts with that pod behind
               and out of traffic; the pod that passed had been out of traffic for 8
               minutes (its drain waited out long generations)   -> RefitVersionSkew,
                                                                     RefitOutOfTrafficSlow
  app=canary   refit step-8 (1 s timeout) still active, its probe inconclusive
                                                                 -> RefitStuck,
                                                                     RefitProbeInconclusive
Operator health: a burst of API errors, and a reconcile loop that last succeeded 15 minutes
ago (the clock passed to Metrics)                                -> RefitReconcileErrors,
                                                                     RefitOperatorNotReconciling
Stages are separate so a scraper sees counters and histograms grow between scrapes.
"""

from __future__ import annotations

from refit_operator.edges.metrics import Metrics

NS = "rl"
FLEETS = ("app=rollout", "app=eval", "app=canary")
STEP_SECONDS = {
    "stage": 0.2,
    "drain": 0.8,
    "sleep": 0.3,
    "wake_weights": 0.4,
    "load": 7.5,
    "wake_kv": 0.5,
    "reset_cache": 0.06,
    "stamp_version": 0.1,
    "probe": 1.9,
    "ready": 0.05,
}
THRESHOLDS = {"mean_abs_diff": 0.05, "max_abs_diff": 0.5, "nll_diff": 0.05}


def _walk(m: Metrics, fleet: str, pod_index: int, *, until: str = "ready") -> None:
    for step, seconds in STEP_SECONDS.items():
        m.step_finished(NS, fleet, step, "success", seconds * (1 + 0.1 * pod_index))
        if step == until:
            return


def stage_start(m: Metrics, now: float) -> None:
    """Three refits begin: every pod pending, all behind the new version."""
    for fleet, refit, version, timeout in (
        ("app=rollout", "step-100", "step-100", 3600.0),
        ("app=eval", "step-7", "step-7", 3600.0),
        ("app=canary", "step-8", "step-8", 1.0),
    ):
        pods = 4 if fleet == "app=rollout" else 2
        m.probe_thresholds(NS, fleet, refit, **THRESHOLDS)
        m.fleet_state(
            NS,
            fleet,
            refit,
            pods_by_phase={"Pending": pods},
            out_of_traffic=0,
            version_skew=pods,
            target_version=version,
            started_at=now - 5,
            timeout_seconds=timeout,
        )
    m.reconcile_done()


def stage_progress(m: Metrics, now: float) -> None:
    """Every pod walks its steps; probes judge; one load times out; the API has a bad minute."""
    for i in range(4):
        _walk(m, "app=rollout", i, until="probe")
        drift = i == 3
        # The read-back before the probe: the pods of one layout agree.
        m.pod_checksum(NS, "app=rollout", f"vllm-{i}", "0123456789ab", "5e" * 16)
        m.probe_result(
            NS,
            "app=rollout",
            "step-100",
            f"vllm-{i}",
            "Fail" if drift else "Pass",
            2.31 + (0.4 if drift else 0.004 * i),
            2.31,
            0.21 if drift else 0.006 + 0.001 * i,
            1.7 if drift else 0.05 + 0.01 * i,
        )
        if not drift:
            m.step_finished(NS, "app=rollout", "ready", "success", 0.05)
            m.pod_out_of_traffic(NS, "app=rollout", 12.0 + i)  # back in traffic
    _walk(m, "app=eval", 0)
    m.probe_result(NS, "app=eval", "step-7", "eval-0", "Pass", 1.92, 1.92, 0.004, 0.03)
    m.pod_out_of_traffic(NS, "app=eval", 480.0)
    _walk(m, "app=eval", 1, until="wake_weights")
    m.step_finished(NS, "app=eval", "load", "timeout", 600.0)
    _walk(m, "app=canary", 0, until="stamp_version")
    m.step_finished(NS, "app=canary", "probe", "timeout", 60.0)
    m.probe_result(NS, "app=canary", "step-8", "canary-0", "Inconclusive", None, 2.05, None, None)
    for _ in range(8):
        m.reconcile_error("api")
    for verb in ("patch", "patch", "get"):
        m.api_retry(verb)
    m.reconcile_done()


def stage_end(m: Metrics, now: float) -> None:
    """Two refits halt; the canary refit stays active past its timeout."""
    m.fleet_state(
        NS,
        "app=rollout",
        "step-100",
        pods_by_phase={"Succeeded": 3, "Failed": 1},
        out_of_traffic=1,
        version_skew=0,
        target_version="step-100",
    )
    m.refit_finished(NS, "app=rollout", "Halted")
    m.fleet_state(
        NS,
        "app=eval",
        "step-7",
        pods_by_phase={"Succeeded": 1, "Failed": 1},
        out_of_traffic=1,
        version_skew=1,
        target_version="step-7",
    )
    m.refit_finished(NS, "app=eval", "Failed")
    m.fleet_state(
        NS,
        "app=canary",
        "step-8",
        pods_by_phase={"Inconclusive": 1, "Pending": 1},
        out_of_traffic=2,
        version_skew=1,
        target_version="step-8",
        started_at=now - 30,
        timeout_seconds=1.0,
    )
    m.reconcile_error("conflict")
    m.api_retry("patch")
    m.reconcile_done()


STAGES = (stage_start, stage_progress, stage_end)


def run_all(m: Metrics, now: float) -> None:
    for stage in STAGES:
        stage(m, now)
