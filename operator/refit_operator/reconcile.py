"""One reconcile of one WeightRefit, pure: what the cluster looks like in, decisions out.

Read it top to bottom: queue → preflight → progress (strategy, gate) → rollback → finish.
The caller (engine.py) gathers the observations, runs the I/O this asks for, and feeds the
results back on the next call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, Protocol

from refit_worker.contract import REQUIRED_CAPABILITIES, RefitInfo

from . import plan
from .api import (
    TERMINAL_PHASES,
    Condition,
    PodResult,
    Previous,
    ProbeSummary,
    WeightRefitSpec,
    WeightRefitStatus,
)
from .podflow import Progress


class Transition(Protocol):
    def __call__(self, phase: str, reason: str, message: str, etype: str = "Normal") -> None: ...


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PodView:
    name: str
    ip: str
    has_gate: bool
    running: bool
    deleting: bool
    ready: bool  # the weights-ready condition is True
    restarts: int
    progress: Progress | None
    uid: str = ""  # a pod recreated under the same name (StatefulSet) is another pod

    def verified(self, version: str) -> bool:
        """At ``version`` with a passed probe and no container restart since."""
        p = self.progress
        return (
            p is not None
            and p.outcome == "Succeeded"
            and p.version == version
            and p.restarts == self.restarts
            and self.ready
        )


@dataclass(frozen=True)
class RefitView:
    name: str
    uid: str
    generation: int
    created: str
    spec: WeightRefitSpec
    status: WeightRefitStatus
    deleting: bool = False
    namespace: str = ""


@dataclass(frozen=True)
class PreflightResult:
    """What the fleet preflight found: refit_info per pod (or the error reaching it), and the
    fleet-level problems (missing Secret, unusable reference)."""

    infos: dict[str, RefitInfo | str] = field(default_factory=dict)  # str: why unreachable
    problem: tuple[str, str] | None = None  # (reason, message)


@dataclass(frozen=True)
class PodStart:
    pod: str
    version: str
    path: str
    rollback: bool
    resume: bool  # continue the recorded progress instead of starting a new pass


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    type: str = "Normal"


@dataclass(frozen=True)
class Observed:
    refit: RefitView
    fleet: Sequence[plan.RefitRef]
    pods: Sequence[PodView]
    in_flight: frozenset[str]
    now: float
    preflight: PreflightResult | None = None
    previous: Previous | None = None  # the fleet's last Succeeded refit other than this one
    vanished: frozenset[str] = frozenset()  # pods deleted while their pass was in flight


@dataclass
class Decision:
    status: WeightRefitStatus
    start: list[PodStart] = field(default_factory=list)
    need_preflight: bool = False
    events: list[Event] = field(default_factory=list)
    # Nothing to do right now (queued, finished, or watching a converged fleet).
    idle: bool = False
    # The fleet's target refit, watching for late or restarted pods.
    watching: bool = False
    release_finalizer: bool = False

    @property
    def dormant(self) -> bool:
        """Finished and not the fleet's target: nothing will happen soon."""
        return self.status.phase in TERMINAL_PHASES and not self.watching


def admission_problem(info: RefitInfo | str, allow_unsafe: bool) -> tuple[str, str] | None:
    """Why a pod must not be refitted, judged from its refit_info; None when it may."""
    if isinstance(info, str):
        return "PodUnreachable", info
    if allow_unsafe:
        return None
    missing = [c for c in REQUIRED_CAPABILITIES if c not in info.capabilities]
    if missing:
        return "UnsafeBackend", f"image lacks reload-safe capabilities: {', '.join(missing)}"
    if info.unsafe_reasons:
        return "UnsafeConfiguration", "; ".join(info.unsafe_reasons)
    return None


def preflight_problem(
    pods: Sequence[PodView], result: PreflightResult, allow_unsafe: bool
) -> tuple[str, str] | None:
    if not pods:
        return "NoPodsSelected", "the fleet selector matches no pods"
    if result.problem is not None:
        return result.problem
    for pod in sorted(pods, key=lambda p: p.name):
        if not pod.has_gate:
            return (
                "MissingReadinessGate",
                f"pod {pod.name} does not declare the readiness gate in spec.readinessGates",
            )
        if not pod.running or not pod.ip:
            return "PodNotRunning", f"pod {pod.name} is not Running with a pod IP"
        info = result.infos.get(pod.name, "no refit_info answer")
        problem = admission_problem(info, allow_unsafe)
        if problem is not None:
            return problem[0], f"pod {pod.name}: {problem[1]}"
    return None


def pod_state(pod: PodView, refit: RefitView, version: str, rollback: bool) -> plan.PodState:
    p = pod.progress
    if pod.deleting:
        return "dropped"
    mine = p is not None and p.uid == refit.uid and p.rollback == rollback and p.version == version
    if not mine or p is None:
        return "passed" if pod.verified(version) and not rollback else "todo"
    if p.outcome == "Succeeded":
        return "passed" if p.restarts == pod.restarts else "todo"
    if p.outcome == "Failed":
        return "failed"
    if p.outcome == "Inconclusive":
        return "inconclusive"
    return "active"


def _conditions(
    phase: str,
    message: str,
    reason: str,
    generation: int,
    old: Sequence[Condition],
    now: float,
    tolerated: int = 0,
) -> list[Condition]:
    """Ready, Progressing, Degraded. A refit that Succeeded with ``tolerated`` pods failed or
    inconclusive within the failure limits is Ready and Degraded (PodsFailedWithinLimits): the
    fleet serves the new version, and someone should look at those pods."""
    ready = phase == "Succeeded"
    progressing = phase in ("Pending", "Preflight", "Progressing", "RollingBack")
    degraded = phase in ("Failed", "Halted", "RollingBack", "RolledBack") or (
        ready and tolerated > 0
    )
    why_degraded = "PodsFailedWithinLimits" if ready else reason
    wanted = [
        ("Ready", ready, reason if not ready else "Succeeded"),
        ("Progressing", progressing, reason if progressing else phase),
        ("Degraded", degraded, why_degraded if degraded else "AsExpected"),
    ]
    before = {c.type: c for c in old}
    out = []
    for ctype, value, why in wanted:
        status: Literal["True", "False"] = "True" if value else "False"
        prev = before.get(ctype)
        changed = prev is None or prev.status != status
        out.append(
            Condition(
                type=ctype,
                status=status,
                reason=why or phase,
                message=message,
                last_transition_time=rfc3339(now)
                if changed or prev is None
                else prev.last_transition_time,
                observed_generation=generation,
            )
        )
    return out


def _pod_results(
    pods: Sequence[PodView],
    refit: RefitView,
    old: Sequence[PodResult],
    vanished: frozenset[str] = frozenset(),
) -> list[PodResult]:
    seen = {p.name for p in pods}
    out = []
    for pod in pods:
        p = pod.progress
        if p is None or p.uid != refit.uid:
            continue
        phase = {
            "Succeeded": "RolledBack" if p.rollback else "Succeeded",
            "Failed": "Failed",
            "Inconclusive": "Inconclusive",
            "": "InProgress",
        }[p.outcome]
        if pod.deleting:
            phase = "Dropped"
        out.append(
            PodResult.model_validate(
                {
                    "name": pod.name,
                    "phase": phase,
                    "step": p.step if p.step else "ready",
                    "version": p.version if p.outcome == "Succeeded" else "",
                    "reason": "PodDeleted" if pod.deleting else p.reason,
                    "message": p.message,
                    "attempts": p.attempts,
                    "startTime": rfc3339(p.started) if p.started else "",
                    "completionTime": rfc3339(p.finished) if p.finished else "",
                    "stepSeconds": p.step_seconds,
                    "probe": p.probe,
                }
            )
        )
    # A pod now in another refit's hands keeps the result this refit recorded for it.
    mine = {r.name for r in out}
    out += [r for r in old if r.name in seen and r.name not in mine]
    # A pod that vanished mid-pass is kept, Dropped, with its reason.
    for r in old:
        if r.name not in seen and r.phase not in ("Succeeded", "RolledBack"):
            out.append(
                r
                if r.phase == "Dropped"
                else r.model_copy(
                    update={
                        "phase": "Dropped",
                        "reason": "PodDeleted",
                        "message": "the pod was deleted mid-refit",
                    }
                )
            )
    listed = {r.name for r in out}
    out += [
        PodResult(
            name=n, phase="Dropped", reason="PodDeleted", message="the pod was deleted mid-refit"
        )
        for n in sorted(vanished - listed - seen)
    ]
    return sorted(out, key=lambda r: r.name)


def _summary(results: Sequence[PodResult]) -> ProbeSummary:
    probes = [r.probe for r in results if r.probe is not None]
    nlls = [p.nll for p in probes if p.verdict == "Pass"]
    return ProbeSummary(
        passed=sum(p.verdict == "Pass" for p in probes),
        failed=sum(p.verdict == "Fail" for p in probes),
        inconclusive=sum(p.verdict == "Inconclusive" for p in probes),
        worst_mean_abs_logprob_diff=max((p.mean_abs_logprob_diff for p in probes), default=0.0),
        worst_max_abs_logprob_diff=max((p.max_abs_logprob_diff for p in probes), default=0.0),
        worst_nll_diff=max((abs(p.nll - p.reference_nll) for p in probes), default=0.0),
        nll_spread=(max(nlls) - min(nlls)) if nlls else 0.0,
    )


def peer_nlls(pods: Sequence[PodView], version: str) -> list[float]:
    """NLLs of pods that passed their probe at ``version`` (cross-pod agreement)."""
    out = []
    for pod in pods:
        p = pod.progress
        if p and p.version == version and p.probe and p.probe.get("verdict") == "Pass":
            out.append(float(p.probe.get("nll", 0.0)))
    return out


def decide(obs: Observed) -> Decision:
    refit, spec = obs.refit, obs.refit.spec
    old = obs.refit.status
    st = old.model_copy(deep=True)
    st.observed_generation = refit.generation
    st.fleet = spec.fleet.selector.canonical()
    d = Decision(status=st)

    def transition(phase: str, reason: str, message: str, etype: str = "Normal") -> None:
        if st.phase != phase or st.message != message:
            d.events.append(Event(reason, message, etype))
        st.phase = phase  # type: ignore[assignment]
        st.message = message
        if phase in TERMINAL_PHASES and not st.completion_time:
            st.completion_time = rfc3339(obs.now)
        tolerated = st.failed_pods + st.inconclusive_pods if phase == "Succeeded" else 0
        st.conditions = _conditions(
            phase, message, reason, refit.generation, old.conditions, obs.now, tolerated
        )

    # ---- queue: one active refit per fleet
    me = plan.RefitRef(refit.name, refit.created, st.phase, spec.queue_policy)
    role = plan.queue_role(me, obs.fleet)
    if role.role == "superseded":
        transition("Superseded", "Superseded", f"superseded by {role.superseded_by} (LatestWins)")
        d.idle = True
        d.release_finalizer = refit.deleting
        return d
    if role.role == "queued":
        st.queue_position = role.position
        transition("Queued", "Queued", f"waiting for {role.position} refit(s) of fleet {st.fleet}")
        d.idle = True
        d.release_finalizer = refit.deleting
        return d
    st.queue_position = 0

    states_for = {
        pod.name: pod_state(pod, refit, spec.checkpoint.version, rollback=False) for pod in obs.pods
    }
    if st.phase in TERMINAL_PHASES and st.phase != "Succeeded":
        d.idle = True  # a finished refit's record stays as it was written
        d.release_finalizer = refit.deleting
        return d
    st.pods = _pod_results(obs.pods, refit, old.pods, obs.vanished)
    st.probe_summary = _summary(st.pods)

    # ---- deletion: finish what is in flight, start nothing new, then let go
    if refit.deleting:
        active = [n for n, s in states_for.items() if s == "active"]
        d.start = [_resume(n, obs, refit) for n in active if n not in obs.in_flight]
        d.release_finalizer = not active and not obs.in_flight
        return d

    # ---- preflight: every pod answers refit_info and is safe to refit, before we touch any
    if st.phase in ("Pending", "Queued"):
        if not st.start_time:
            st.start_time = rfc3339(obs.now)
        if st.previous is None and obs.previous is not None:
            st.previous = obs.previous
        transition("Preflight", "Preflight", "checking every pod of the fleet before touching any")
    if st.phase == "Preflight":
        if obs.preflight is None:
            d.need_preflight = True
            return d
        problem = preflight_problem(obs.pods, obs.preflight, spec.allow_unsafe_backends)
        st.target_pods = len(obs.pods)
        if problem is not None:
            transition("Failed", problem[0], problem[1], "Warning")
            d.idle = True
            return d
        transition(
            "Progressing",
            "Progressing",
            f"refitting {len(obs.pods)} pods to {spec.checkpoint.version}",
        )

    if st.phase in ("Progressing", "Succeeded"):
        _progress(obs, d, states_for, transition)
    elif st.phase == "RollingBack":
        _rollback(obs, d, transition)
    else:
        d.idle = True
    return d


def _resume(name: str, obs: Observed, refit: RefitView) -> PodStart:
    pod = next(p for p in obs.pods if p.name == name)
    assert pod.progress is not None
    p = pod.progress
    return PodStart(name, p.version, p.path, p.rollback, resume=True)


def _count(st: WeightRefitStatus, states: dict[str, plan.PodState]) -> None:
    st.target_pods = len(states)
    st.updated_pods = sum(s == "passed" for s in states.values())
    st.failed_pods = sum(s in ("failed", "dropped") for s in states.values())
    st.inconclusive_pods = sum(s == "inconclusive" for s in states.values())


def _progress(
    obs: Observed, d: Decision, states: dict[str, plan.PodState], transition: Transition
) -> None:
    refit, spec, st = obs.refit, obs.refit.spec, d.status
    # Dropped pods (deleted mid-refit) leave the fleet: recorded in status.pods, not counted.
    states = {n: s for n, s in states.items() if s != "dropped"}
    _count(st, states)
    resumes = [
        _resume(n, obs, refit)
        for n, s in states.items()
        if s == "active" and n not in obs.in_flight
    ]
    if st.phase == "Succeeded":
        # Convergence: the fleet's target refit brings late or restarted pods to its version,
        # unless another refit of the fleet has taken over.
        if plan.fleet_target(obs.fleet) != refit.name or any(
            r.phase not in TERMINAL_PHASES for r in obs.fleet if r.name != refit.name
        ):
            d.idle = True
            return
        d.start = resumes + [_fresh(n, spec) for n, s in states.items() if s == "todo"]
        d.idle = not d.start and not obs.in_flight
        d.watching = True
        return

    started = _started(st)
    timed_out = started is not None and obs.now - started > spec.sequence.total_timeout_seconds
    g = plan.gate(states, spec.probe)
    if timed_out and not g.tripped:
        limit = spec.sequence.total_timeout_seconds
        g = plan.Gate(True, "TotalTimeoutExceeded", f"the refit ran past {limit}s")
    if not g.tripped:
        starts = plan.next_pods(states, spec.strategy)
        d.start = resumes + [_fresh(n, spec) for n in starts]
        if plan.all_settled(states) and not obs.in_flight and not d.start:
            degraded = st.failed_pods + st.inconclusive_pods
            msg = f"{st.updated_pods}/{st.target_pods} pods at {spec.checkpoint.version}"
            if degraded:
                msg += f"; {degraded} failed or inconclusive within the limits"
            transition("Succeeded", "Succeeded", msg)
            d.watching = True  # the next tick decides whether it is the fleet's target
        return
    # Gate tripped: start nothing new, let pods in flight finish their pass (bounded).
    d.start = resumes
    if any(s == "active" for s in states.values()) or obs.in_flight:
        st.message = f"stopping: {g.message}; waiting for pods in flight"
        return
    if spec.on_failure == "Halt":
        transition("Halted", g.reason, f"halted: {g.message}", "Warning")
        d.idle = True
        return
    if st.previous is None or not st.previous.version:
        msg = f"{g.message}; no previous version recorded for this fleet"
        transition("Halted", "NoRollbackTarget", msg, "Warning")
        d.idle = True
        return
    msg = f"{g.message}; rolling back to {st.previous.version}"
    transition("RollingBack", g.reason, msg, "Warning")
    _rollback(obs, d, transition)


def _started(st: WeightRefitStatus) -> float | None:
    if not st.start_time:
        return None
    return datetime.strptime(st.start_time, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _fresh(name: str, spec: WeightRefitSpec) -> PodStart:
    return PodStart(
        name, spec.checkpoint.version, spec.checkpoint.path, rollback=False, resume=False
    )


def _rollback(obs: Observed, d: Decision, transition: Transition) -> None:
    """Every pod this refit touched goes back to the previous version and is probed."""
    refit, st = obs.refit, d.status
    assert st.previous is not None
    prev = st.previous
    touched = [
        p
        for p in obs.pods
        if p.progress is not None and p.progress.uid == refit.uid and not p.deleting
    ]
    states = {p.name: pod_state(p, refit, prev.version, rollback=True) for p in touched}
    d.start = [
        _resume(n, obs, refit)
        for n, s in states.items()
        if s == "active" and n not in obs.in_flight
    ] + [
        PodStart(n, prev.version, prev.path, rollback=True, resume=False)
        for n, s in states.items()
        if s == "todo"
    ]
    if plan.all_settled(states) and not obs.in_flight and not d.start:
        bad = [n for n, s in states.items() if s != "passed"]
        if bad:
            transition(
                "Failed",
                "RollbackFailed",
                f"rollback failed on {', '.join(sorted(bad))}",
                "Warning",
            )
        else:
            transition(
                "RolledBack",
                "RolledBack",
                f"{len(states)} pods rolled back to {prev.version}",
                "Warning",
            )
        d.idle = True
