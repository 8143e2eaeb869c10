"""Prometheus metrics of the operator: reload health, step timings, fleet state, operator health.

Every metric is documented in docs/metrics.md. Labels are bounded: namespace, fleet, refit and
pod come from Kubernetes object names; step, result, phase, kind and verb are closed enums
(normalised here to snake_case). Free text such as a version appears only in the `_info` metric.

The module-level functions are the interface the operator calls (owners.md, interface 4); they
delegate to one `Metrics` instance on the default registry. Tests build their own `Metrics` on a
private `CollectorRegistry` so they never share state.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from ..core import sequences

log = logging.getLogger(__name__)

# The *_created series double every counter and histogram and no dashboard or alert uses them.
disable_created_metrics()

_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")


def _snake(value: str) -> str:
    """'wakeWeights' -> 'wake_weights', 'RolledBack' -> 'rolled_back', 'Pass' -> 'pass'."""
    return _CAMEL.sub(r"_\1", value.strip()).replace("-", "_").lower()


# The per-pod sequence (sequences.STEPS, snake_case): their series exist from a fleet's first call.
PIPELINE_STEPS: Final = tuple(_snake(s) for s in sequences.STEPS)
# Also accepted: every other step (sequences.Step: an adapter pass's own, and restore, which
# puts a pod whose load was refused back to serving its earlier weights), and resume and
# rollback.
STEPS: Final = frozenset({*(_snake(s) for s in sequences.Step), "resume", "rollback"})
STEP_RESULTS: Final = frozenset({"success", "failure", "timeout"})
VERDICTS: Final = ("pass", "fail", "inconclusive")
REFIT_RESULTS: Final = frozenset(
    {"succeeded", "failed", "halted", "rolled_back", "superseded", "timed_out"}
)
POD_PHASES: Final = (
    "pending",
    "in_progress",
    "succeeded",
    "failed",
    "inconclusive",
    "dropped",
    "rolled_back",
)
# Error kinds and API verbs are recorded on failure paths, where raising would hide the real
# error; anything outside these sets is counted as "other" (and logged) instead.
ERROR_KINDS: Final = frozenset(
    {"api", "conflict", "not_found", "worker", "timeout", "invalid", "permission", "internal"}
)
API_VERBS: Final = frozenset({"get", "list", "watch", "create", "update", "patch", "delete"})

# Step durations span a 50 ms prefix-cache reset to a multi-minute load of a large checkpoint.
STEP_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A pod's time out of traffic spans a sub-second swap from staged memory to a 30-minute pass
# (retries, a slow load). 300 s is a bound: the RefitOutOfTrafficSlow alert's threshold.
OUT_OF_TRAFFIC_BUCKETS: Final = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)

_ENUM_VALUE = re.compile(r"^[a-z][a-z0-9_]*$")


def _enum(what: str, value: str, allowed: frozenset[str] | tuple[str, ...]) -> str:
    normalised = _snake(value)
    if normalised not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(allowed)}")
    return normalised


def _lenient_enum(what: str, value: str, allowed: frozenset[str]) -> str:
    normalised = _snake(value)
    if normalised in allowed:
        return normalised
    log.warning("metrics: unknown %s %r counted as 'other'", what, value)
    return "other"


def _name(what: str, value: str) -> str:
    if not value or len(value) > 253:
        raise ValueError(f"{what} must be a Kubernetes name (1..253 characters), got {value!r}")
    return value


class Metrics:
    """All operator metrics on one registry."""

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, clock: Callable[[], float] = time.time
    ) -> None:
        self.registry = registry
        self._clock = clock
        self._lock = threading.Lock()
        # (namespace, fleet, pod) -> refit of its current probe series, so a pod probed by a
        # newer refit does not keep the older refit's series alive.
        self._pod_refit: dict[tuple[str, str, str], str] = {}
        # (namespace, fleet) -> (refit, version) of the current fleet-state series.
        self._fleet_refit: dict[tuple[str, str], tuple[str, str]] = {}
        # (namespace, fleet, pod) -> (layout, checksum) of its current checksum-info series.
        self._pod_checksum: dict[tuple[str, str, str], tuple[str, str]] = {}
        # Fleets whose counters and histograms exist (at 0) already; see _ensure_fleet.
        self._fleets: set[tuple[str, str]] = set()

        pod_labels = ("namespace", "fleet", "refit", "pod")
        r = registry
        self.probe_nll = Gauge(
            "refit_probe_nll_nats",
            "Mean negative log-likelihood per token of the probe prompts on the pod.",
            pod_labels,
            registry=r,
        )
        self.probe_reference_nll = Gauge(
            "refit_probe_reference_nll_nats",
            "Mean NLL per token of the probe prompts in the checkpoint's reference.",
            pod_labels,
            registry=r,
        )
        self.probe_mean_abs_diff = Gauge(
            "refit_probe_logprob_abs_diff_mean_nats",
            "Mean over probe tokens of |logprob_pod - logprob_reference|.",
            pod_labels,
            registry=r,
        )
        self.probe_max_abs_diff = Gauge(
            "refit_probe_logprob_abs_diff_max_nats",
            "Largest single-token |logprob_pod - logprob_reference| of the probe.",
            pod_labels,
            registry=r,
        )
        self.pod_weights_checksum = Gauge(
            "refit_pod_weights_checksum_info",
            "The read-back checksum of the pod's runtime weights after its last load (vLLM's "
            "weight checker and the buffers' digests), with the layout it was read in: pods "
            "of one layout serving one version show one checksum.",
            ("namespace", "fleet", "pod", "layout", "checksum"),
            registry=r,
        )
        self.probe_verdict = Gauge(
            "refit_probe_verdict",
            "Latest probe verdict of the pod as a state set: 1 for the current result, else 0.",
            (*pod_labels, "result"),
            registry=r,
        )
        self.probe_verdicts = Counter(
            "refit_probe_verdicts",
            "Probe verdicts given, by result.",
            ("namespace", "fleet", "result"),
            registry=r,
        )
        self.threshold_mean_abs_diff = Gauge(
            "refit_probe_threshold_logprob_abs_diff_mean_nats",
            "The refit's spec.probe.thresholds.meanAbsLogprobDiff.",
            ("namespace", "fleet", "refit"),
            registry=r,
        )
        self.threshold_max_abs_diff = Gauge(
            "refit_probe_threshold_logprob_abs_diff_max_nats",
            "The refit's spec.probe.thresholds.maxAbsLogprobDiff.",
            ("namespace", "fleet", "refit"),
            registry=r,
        )
        self.threshold_nll_diff = Gauge(
            "refit_probe_threshold_nll_diff_nats",
            "The refit's spec.probe.thresholds.nllDiff (allowed |NLL_pod - NLL_reference|).",
            ("namespace", "fleet", "refit"),
            registry=r,
        )
        self.step_duration = Histogram(
            "refit_step_duration_seconds",
            "Duration of one per-pod refit step, by step and result.",
            ("namespace", "fleet", "step", "result"),
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.pod_out_of_traffic_seconds = Histogram(
            "refit_pod_out_of_traffic_seconds",
            "Seconds a refit pass kept a pod out of traffic (weights-ready condition False to "
            "True), observed when the pass puts the pod back.",
            ("namespace", "fleet"),
            buckets=OUT_OF_TRAFFIC_BUCKETS,
            registry=r,
        )
        self.refits = Counter(
            "refit_refits",
            "Refits that reached a terminal phase, by result.",
            ("namespace", "fleet", "result"),
            registry=r,
        )
        self.pods = Gauge(
            "refit_pods",
            "Pods of the fleet's current refit, by per-pod phase.",
            ("namespace", "fleet", "refit", "phase"),
            registry=r,
        )
        self.out_of_traffic = Gauge(
            "refit_fleet_pods_out_of_traffic",
            "Fleet pods whose weights-ready readiness condition is False.",
            ("namespace", "fleet"),
            registry=r,
        )
        self.version_skew = Gauge(
            "refit_fleet_version_skew",
            "Fleet pods whose weight version is not the fleet's target version.",
            ("namespace", "fleet"),
            registry=r,
        )
        self.target_version = Gauge(
            "refit_fleet_target_version_info",
            "The fleet's target weight version and the refit that sets it (always 1).",
            ("namespace", "fleet", "refit", "version"),
            registry=r,
        )
        self.refit_start = Gauge(
            "refit_active_refit_start_time_seconds",
            "Unix time the fleet's active (non-terminal) refit started.",
            ("namespace", "fleet", "refit"),
            registry=r,
        )
        self.refit_timeout = Gauge(
            "refit_active_refit_timeout_seconds",
            "spec.sequence.totalTimeoutSeconds of the fleet's active refit.",
            ("namespace", "fleet", "refit"),
            registry=r,
        )
        self.reconcile_errors = Counter(
            "refit_operator_reconcile_errors",
            "Reconcile passes that ended in an error, by kind.",
            ("kind",),
            registry=r,
        )
        self.api_retries = Counter(
            "refit_operator_api_retries",
            "Kubernetes API calls retried (conflict, throttling, transient failure), by verb.",
            ("verb",),
            registry=r,
        )
        self.reconciles = Counter(
            "refit_operator_reconciles",
            "Reconcile passes that completed without error.",
            registry=r,
        )
        self.last_reconcile = Gauge(
            "refit_operator_last_successful_reconcile_timestamp_seconds",
            "Unix time of the last reconcile pass that completed without error.",
            registry=r,
        )
        for kind in (*ERROR_KINDS, "other"):
            self.reconcile_errors.labels(kind)
        for verb in (*API_VERBS, "other"):
            self.api_retries.labels(verb)

    def _ensure_fleet(self, namespace: str, fleet: str) -> None:
        """Create a fleet's counter and histogram series at 0 the first time it is seen.

        Refits are rare events: without this, the first step, verdict or outcome of a fleet
        would create its series already at 1, and increase()/rate() would never count it.
        """
        key = (namespace, fleet)
        if key in self._fleets:
            return
        self._fleets.add(key)
        for step in PIPELINE_STEPS:
            for result in STEP_RESULTS:
                self.step_duration.labels(namespace, fleet, step, result)
        self.pod_out_of_traffic_seconds.labels(namespace, fleet)
        for verdict in VERDICTS:
            self.probe_verdicts.labels(namespace, fleet, verdict)
        for outcome in REFIT_RESULTS:
            self.refits.labels(namespace, fleet, outcome)

    # -- probes -------------------------------------------------------------------------------

    def probe_result(
        self,
        namespace: str,
        fleet: str,
        refit: str,
        pod: str,
        verdict: str,
        nll: float | None,
        reference_nll: float | None,
        mean_abs_diff: float | None,
        max_abs_diff: float | None,
    ) -> None:
        """Record one pod's probe.

        A value that is None or not finite (no data, NaN logprobs) leaves its series absent:
        the verdict says what happened, and dashboards cannot draw NaN or inf.
        """
        key = (_name("namespace", namespace), _name("fleet", fleet), _name("pod", pod))
        _name("refit", refit)
        result = _enum("verdict", verdict, VERDICTS)
        with self._lock:
            self._ensure_fleet(namespace, fleet)
            previous = self._pod_refit.get(key)
            if previous is not None and previous != refit:
                self._remove_pod_series(*key, previous)
            self._pod_refit[key] = refit
            labels = (namespace, fleet, refit, pod)
            for gauge, value in (
                (self.probe_nll, nll),
                (self.probe_reference_nll, reference_nll),
                (self.probe_mean_abs_diff, mean_abs_diff),
                (self.probe_max_abs_diff, max_abs_diff),
            ):
                if value is None or not math.isfinite(value):
                    self._remove(gauge, labels)
                else:
                    gauge.labels(*labels).set(value)
            for state in VERDICTS:
                self.probe_verdict.labels(*labels, state).set(1 if state == result else 0)
            self.probe_verdicts.labels(namespace, fleet, result).inc()

    def probe_thresholds(
        self,
        namespace: str,
        fleet: str,
        refit: str,
        *,
        mean_abs_diff: float,
        max_abs_diff: float,
        nll_diff: float,
    ) -> None:
        """Export the refit's probe thresholds so dashboards draw them next to the values."""
        labels = (_name("namespace", namespace), _name("fleet", fleet), _name("refit", refit))
        self.threshold_mean_abs_diff.labels(*labels).set(mean_abs_diff)
        self.threshold_max_abs_diff.labels(*labels).set(max_abs_diff)
        self.threshold_nll_diff.labels(*labels).set(nll_diff)

    def pod_checksum(
        self, namespace: str, fleet: str, pod: str, layout: str, checksum: str
    ) -> None:
        """The pod's read-back (checksums.py): one series per pod, the latest."""
        key = (_name("namespace", namespace), _name("fleet", fleet), _name("pod", pod))
        with self._lock:
            previous = self._pod_checksum.get(key)
            if previous is not None and previous != (layout, checksum):
                self._remove(self.pod_weights_checksum, (*key, *previous))
            self._pod_checksum[key] = (layout, checksum)
            self.pod_weights_checksum.labels(*key, layout, checksum).set(1)

    def forget_pod(self, namespace: str, fleet: str, pod: str) -> None:
        """Drop every series of a pod that left the fleet."""
        with self._lock:
            checksum = self._pod_checksum.pop((namespace, fleet, pod), None)
            if checksum is not None:
                self._remove(self.pod_weights_checksum, (namespace, fleet, pod, *checksum))
            refit = self._pod_refit.pop((namespace, fleet, pod), None)
            if refit is not None:
                self._remove_pod_series(namespace, fleet, pod, refit)

    def _remove_pod_series(self, namespace: str, fleet: str, pod: str, refit: str) -> None:
        labels = (namespace, fleet, refit, pod)
        for gauge in (
            self.probe_nll,
            self.probe_reference_nll,
            self.probe_mean_abs_diff,
            self.probe_max_abs_diff,
        ):
            self._remove(gauge, labels)
        for state in VERDICTS:
            self._remove(self.probe_verdict, (*labels, state))

    # -- steps and refits ---------------------------------------------------------------------

    def step_finished(
        self, namespace: str, fleet: str, step: str, result: str, seconds: float
    ) -> None:
        if seconds < 0:
            raise ValueError(f"step duration must be >= 0 seconds, got {seconds}")
        labels = (
            _name("namespace", namespace),
            _name("fleet", fleet),
            _enum("step", step, STEPS),
            _enum("step result", result, STEP_RESULTS),
        )
        with self._lock:
            self._ensure_fleet(namespace, fleet)
        self.step_duration.labels(*labels).observe(seconds)

    def pod_out_of_traffic(self, namespace: str, fleet: str, seconds: float) -> None:
        """A pass put a pod back into traffic after ``seconds`` out of it (from its readiness
        condition going False to True: podflow.out_of_traffic_seconds). Call once per pass
        that puts a pod back (Succeeded, or restored to its earlier weights); a pod left out
        of traffic is not observed (refit_fleet_pods_out_of_traffic counts it)."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"time out of traffic must be >= 0 seconds, got {seconds}")
        labels = (_name("namespace", namespace), _name("fleet", fleet))
        with self._lock:
            self._ensure_fleet(*labels)
        self.pod_out_of_traffic_seconds.labels(*labels).observe(seconds)

    def refit_finished(
        self, namespace: str, fleet: str, result: str, refit: str | None = None
    ) -> None:
        """Count a refit that reached a terminal phase; it is no longer the fleet's active one.

        refit: the refit that ended (default: the fleet's current one in fleet_state).
        """
        outcome = _enum("refit result", result, REFIT_RESULTS)
        _name("namespace", namespace)
        _name("fleet", fleet)
        with self._lock:
            self._ensure_fleet(namespace, fleet)
            self.refits.labels(namespace, fleet, outcome).inc()
            current = self._fleet_refit.get((namespace, fleet))
            ended = refit if refit is not None else (current[0] if current else None)
            if ended is not None:
                self._remove(self.refit_start, (namespace, fleet, ended))
                self._remove(self.refit_timeout, (namespace, fleet, ended))

    def fleet_state(
        self,
        namespace: str,
        fleet: str,
        refit: str,
        *,
        pods_by_phase: Mapping[str, int],
        out_of_traffic: int,
        version_skew: int,
        target_version: str,
        started_at: float | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        """The fleet as the operator last observed it, for its current refit.

        started_at/timeout_seconds describe the refit while it is active (non-terminal); pass
        them on every call until refit_finished. They drive the RefitStuck alert.
        """
        phases = {_enum("pod phase", p, POD_PHASES): n for p, n in pods_by_phase.items()}
        if any(n < 0 for n in (*phases.values(), out_of_traffic, version_skew)):
            raise ValueError("pod counts must be >= 0")
        key = (_name("namespace", namespace), _name("fleet", fleet))
        _name("refit", refit)
        if not target_version:
            raise ValueError("target_version must not be empty")
        with self._lock:
            self._ensure_fleet(*key)
            previous = self._fleet_refit.get(key)
            if previous is not None and previous != (refit, target_version):
                old_refit, old_version = previous
                self._remove(self.target_version, (*key, old_refit, old_version))
                if old_refit != refit:
                    self._remove_refit_series(*key, old_refit)
            self._fleet_refit[key] = (refit, target_version)
            for phase in POD_PHASES:
                self.pods.labels(*key, refit, phase).set(phases.get(phase, 0))
            self.out_of_traffic.labels(*key).set(out_of_traffic)
            self.version_skew.labels(*key).set(version_skew)
            self.target_version.labels(*key, refit, target_version).set(1)
            if started_at is not None:
                self.refit_start.labels(*key, refit).set(started_at)
            if timeout_seconds is not None:
                self.refit_timeout.labels(*key, refit).set(timeout_seconds)

    def forget_fleet(self, namespace: str, fleet: str) -> None:
        """Drop the fleet-state and probe series of a fleet that no longer has any refit."""
        with self._lock:
            current = self._fleet_refit.pop((namespace, fleet), None)
            if current is not None:
                refit, version = current
                self._remove(self.target_version, (namespace, fleet, refit, version))
                self._remove_refit_series(namespace, fleet, refit)
            self._remove(self.out_of_traffic, (namespace, fleet))
            self._remove(self.version_skew, (namespace, fleet))
            if (namespace, fleet) in self._fleets:
                self._fleets.discard((namespace, fleet))
                for step in STEPS:
                    for result in STEP_RESULTS:
                        self._remove(self.step_duration, (namespace, fleet, step, result))
                self._remove(self.pod_out_of_traffic_seconds, (namespace, fleet))
                for verdict in VERDICTS:
                    self._remove(self.probe_verdicts, (namespace, fleet, verdict))
                for outcome in REFIT_RESULTS:
                    self._remove(self.refits, (namespace, fleet, outcome))
            for key, pod_refit in list(self._pod_refit.items()):
                if key[:2] == (namespace, fleet):
                    del self._pod_refit[key]
                    self._remove_pod_series(namespace, fleet, key[2], pod_refit)
            for key, checksum in list(self._pod_checksum.items()):
                if key[:2] == (namespace, fleet):
                    del self._pod_checksum[key]
                    self._remove(self.pod_weights_checksum, (*key, *checksum))

    def forget_refit(self, namespace: str, fleet: str, refit: str) -> None:
        """Drop every series labelled with a refit that no longer exists (deleted by the
        garbage collector or by hand): its pod counts, active-refit and threshold gauges, the
        probe series of pods it probed last, and the fleet's target-version info if it names
        it. Per-fleet counters and histograms (no refit label) keep counting."""
        with self._lock:
            key = (namespace, fleet)
            current = self._fleet_refit.get(key)
            if current is not None and current[0] == refit:
                del self._fleet_refit[key]
                self._remove(self.target_version, (*key, *current))
            self._remove_refit_series(namespace, fleet, refit)
            for pod_key, pod_refit in list(self._pod_refit.items()):
                if pod_key[:2] == key and pod_refit == refit:
                    del self._pod_refit[pod_key]
                    self._remove_pod_series(namespace, fleet, pod_key[2], refit)

    def _remove_refit_series(self, namespace: str, fleet: str, refit: str) -> None:
        for phase in POD_PHASES:
            self._remove(self.pods, (namespace, fleet, refit, phase))
        for gauge in (
            self.refit_start,
            self.refit_timeout,
            self.threshold_mean_abs_diff,
            self.threshold_max_abs_diff,
            self.threshold_nll_diff,
        ):
            self._remove(gauge, (namespace, fleet, refit))

    # -- operator health ----------------------------------------------------------------------

    def reconcile_error(self, kind: str) -> None:
        self.reconcile_errors.labels(_lenient_enum("error kind", kind, ERROR_KINDS)).inc()

    def api_retry(self, verb: str) -> None:
        self.api_retries.labels(_lenient_enum("API verb", verb, API_VERBS)).inc()

    def reconcile_done(self) -> None:
        self.reconciles.inc()
        self.last_reconcile.set(self._clock())

    @staticmethod
    def _remove(metric: Gauge | Counter | Histogram, labels: tuple[str, ...]) -> None:
        try:
            metric.remove(*labels)
        except KeyError:
            pass  # never set: nothing to drop


# The operator's metrics on prometheus_client's default registry (with process_* metrics).
METRICS: Final = Metrics()

step_finished = METRICS.step_finished
pod_out_of_traffic = METRICS.pod_out_of_traffic
probe_result = METRICS.probe_result
pod_checksum = METRICS.pod_checksum
probe_thresholds = METRICS.probe_thresholds
refit_finished = METRICS.refit_finished
fleet_state = METRICS.fleet_state
forget_pod = METRICS.forget_pod
forget_fleet = METRICS.forget_fleet
forget_refit = METRICS.forget_refit
reconcile_error = METRICS.reconcile_error
api_retry = METRICS.api_retry
reconcile_done = METRICS.reconcile_done


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose /metrics of the default registry on a background thread."""
    start_http_server(port, addr=addr, registry=METRICS.registry)
