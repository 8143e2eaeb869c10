"""One reconcile of one WeightRefit, pure: what the cluster looks like in, decisions out.

Read it top to bottom: queue → preflight → progress (strategy, gate) → rollback → finish.
The caller (engine.py) gathers the observations, runs the I/O this asks for, and feeds the
results back on the next call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from refit_worker.contract import REQUIRED_CAPABILITIES, RefitInfo

from . import plan, times, traffic
from .api import (
    STATUS_PODS_LIMIT,
    TERMINAL_PHASES,
    BroadcastRound,
    Condition,
    PodProbe,
    PodResult,
    Previous,
    ProbeSummary,
    WeightRefitSpec,
    WeightRefitStatus,
)
from .podflow import PodView, Progress
from .times import rfc3339


class Transition(Protocol):
    def __call__(self, phase: str, reason: str, message: str, etype: str = "Normal") -> None: ...


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
    # False for a pod whose weights are another fleet's (moved here by its labels): it leaves
    # traffic at the pass's start instead of serving them while the checkpoint stages.
    keep_serving: bool = True


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
    # uid -> name of every WeightRefit of the namespace: a claim whose refit is gone is stale.
    refits: Mapping[str, str] = field(default_factory=dict)
    # A broadcast refit's current round as the engine's rounds see it (None: no round yet).
    broadcast: BroadcastRound | None = None
    # Pods whose claim belongs to another operator process (a replica or another installation)
    # that may still act: its pass drives the pod, whatever refit it serves, and no pass of
    # this process takes it over (leader.holder_alive).
    elsewhere: frozenset[str] = frozenset()


@dataclass
class Decision:
    status: WeightRefitStatus
    start: list[PodStart] = field(default_factory=list)
    # Pods whose checkpoint to stage now, ahead of their turn (Rolling's next batch).
    stage_ahead: list[str] = field(default_factory=list)
    need_preflight: bool = False
    events: list[Event] = field(default_factory=list)
    # Nothing to do right now (queued, finished, or watching a converged fleet).
    idle: bool = False
    # The fleet's target refit, watching for late or restarted pods.
    watching: bool = False
    release_finalizer: bool = False
    # Pods to take out of traffic now, with the reason and message for their condition: in
    # traffic while their container restarted since their pass (the weights it loaded are
    # gone), before any pass can begin on them; serving another fleet's weights (moved here by
    # their labels); left by a rollback with no checkpoint to go back to.
    withdraw: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def dormant(self) -> bool:
        """Finished and not the fleet's target: nothing will happen soon."""
        return self.status.phase in TERMINAL_PHASES and not self.watching


def admission_problem(
    info: RefitInfo | str, allow_unsafe: bool, sleep_level: int
) -> tuple[str, str] | None:
    """Why a pod must not be refitted, judged from its refit_info and the spec's
    ``sequence.sleepLevel``; None when it may."""
    if isinstance(info, str):
        return "PodUnreachable", info
    if allow_unsafe:
        return None
    missing = [c for c in REQUIRED_CAPABILITIES if c not in info.capabilities]
    if missing:
        return "UnsafeBackend", f"image lacks reload-safe capabilities: {', '.join(missing)}"
    if info.unsafe_reasons:
        return "UnsafeConfiguration", "; ".join(info.unsafe_reasons)
    if info.kv_cache_scales and sleep_level == 2:
        # Level 2 discards the scale parameters with the weights and the wake does not
        # restore them; a reload whose checkpoint lacks them leaves zeros (vLLM #57163).
        return "UnsafeSleepLevel", (
            f"sleepLevel 2 discards the KV cache scales ({info.kv_cache_scales} checkpoint "
            "parameters) and waking does not restore them (vLLM #57163); use sleepLevel 1"
        )
    return None


def admitted_spec(spec: WeightRefitSpec, status: WeightRefitStatus) -> WeightRefitSpec:
    """The spec every decision and pass of a started refit acts on: spec.sequence as its
    preflight admitted it (status.sequence). The CRD refuses a change of spec.sequence, but an
    API server with an older CRD accepts one (e.g. sleepLevel 2 after level 1 was admitted):
    acting on it would skip the level-2 refusals and run another step set on pods slept at
    the old level. A refit not started yet (no record) is admitted with what it says then."""
    if status.sequence is None or status.sequence == spec.sequence:
        return spec
    return spec.model_copy(update={"sequence": status.sequence})


def fleet_problem(pods: Sequence[PodView]) -> tuple[str, str] | None:
    """What the Pod objects alone hold against the fleet. Judged before the preflight calls
    any pod: the admin token goes only to pods that pass (PodView.vetted)."""
    if not pods:
        return "NoPodsSelected", "the fleet selector matches no pods"
    for pod in sorted(pods, key=lambda p: p.name):
        if not pod.has_gate:
            return (
                "MissingReadinessGate",
                f"pod {pod.name} does not declare the readiness gate in spec.readinessGates",
            )
        if not pod.running or not pod.ip:
            return "PodNotRunning", f"pod {pod.name} is not Running with a pod IP"
    return None


def preflight_problem(
    pods: Sequence[PodView],
    result: PreflightResult,
    allow_unsafe: bool,
    sleep_level: int,
) -> tuple[str, str] | None:
    problem = fleet_problem(pods)
    if problem is not None:
        return problem
    if result.problem is not None:
        return result.problem
    for pod in sorted(pods, key=lambda p: p.name):
        info = result.infos.get(pod.name, "no refit_info answer")
        problem = admission_problem(info, allow_unsafe, sleep_level)
        if problem is not None:
            return problem[0], f"pod {pod.name}: {problem[1]}"
    return None


def holder(
    pod: PodView, refit: RefitView, refits: Mapping[str, str], elsewhere: Set[str] = frozenset()
) -> str:
    """Whose pass holds the pod, when it is not this refit's to drive: another refit's, or
    any refit's pass of another operator process that may still act (``elsewhere``), named
    with that process. "" when the pod is free, held by a pass of this refit that this process
    may take over, or held by a refit that no longer exists: a claim outlives only a crashed
    pass."""
    c = pod.claim
    if c is None or c.uid not in refits:
        return ""
    if pod.name in elsewhere:
        return f"{c.refit} (operator {c.holder})"
    return "" if c.uid == refit.uid else c.refit


def foreign(pod: PodView, fleet: Sequence[plan.RefitRef], refits: Mapping[str, str]) -> bool:
    """Whether the pod's record is the pass of a refit that exists and no longer selects it:
    its labels moved it into this fleet, with weights that are another fleet's. ``fleet``
    holds every refit that selects a pod of this one's fleet, so one that selects this pod."""
    p = pod.progress
    if p is None or refits.get(p.uid) != p.refit:
        return False
    return not any(r.name == p.refit and r.selects(pod.labels) for r in fleet)


def moved_on(
    pod: PodView,
    refit: RefitView,
    version: str,
    fleet: Sequence[plan.RefitRef],
    refits: Mapping[str, str] | None,
) -> bool:
    """Whether a newer refit answers for the pod (docs/concepts.md, "Which refit wins"): its
    pass is the pod's record and what it left stands. It does not once the pod left that
    refit's fleet (labels), nor once the container restarted since a pass of a refit that
    ended without succeeding (the pod lost those weights: its target converges it), nor, for
    a refit since deleted, once the pod no longer serves the version it left."""
    p = pod.progress
    if p is None or p.uid == refit.uid or not p.newer_than(refit.created, refit.name):
        return False
    if p.rollback and p.version == version:  # rolled back to us: still ours
        return False
    if refits is None:  # the other refits unknown (a dry run): the record stands
        return True
    if p.uid not in refits:
        return bool(pod.serving)
    if foreign(pod, fleet, refits):
        return False
    lost = p.finished_pass and p.restarts != pod.restarts
    phase = next((r.phase for r in fleet if r.name == p.refit), "")
    return not lost or phase == "Succeeded" or phase not in TERMINAL_PHASES


def pod_state(
    pod: PodView,
    refit: RefitView,
    version: str,
    rollback: bool,
    refits: Mapping[str, str] | None = None,
    elsewhere: Set[str] = frozenset(),
    fleet: Sequence[plan.RefitRef] = (),
) -> plan.PodState:
    p = pod.progress
    if pod.deleting:
        return "dropped"
    # A newer refit has driven the pod (or drives it now): it has moved on, and this refit
    # neither counts it nor takes it back (two refits never fight over a pod).
    if moved_on(pod, refit, version, fleet, refits):
        return "superseded"
    if holder(pod, refit, refits or {}, elsewhere):
        return "blocked"
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


# status.pods lists only the pods that need a person's attention, worst first (rank, then
# name). A pod that succeeded or rolled back is not listed: its record is its progress
# annotation, so the WeightRefit stays small at any fleet size (api.STATUS_PODS_LIMIT).
ATTENTION: Final[Mapping[str, int]] = {
    "Failed": 0,
    "Inconclusive": 1,
    "Dropped": 2,
    "InProgress": 3,
}
_DELETED = "the pod was deleted mid-refit"


def pod_phase(p: Progress, deleting: bool = False) -> str:
    """The status phase of a pod whose progress is this refit's pass."""
    if deleting:
        return "Dropped"
    return {
        "Succeeded": "RolledBack" if p.rollback else "Succeeded",
        "Failed": "Failed",
        "Inconclusive": "Inconclusive",
        "": "InProgress",
    }[p.outcome]


def pod_result(name: str, p: Progress, deleting: bool = False) -> PodResult:
    """A pod's record (its progress annotation, or the live progress of a pass in flight) as
    a status.pods entry; `kubectl refit status` and the report draw every pod with it."""
    return PodResult.model_validate(
        {
            "name": name,
            "phase": pod_phase(p, deleting),
            "step": p.step if p.step else "ready",
            "version": p.version if p.outcome == "Succeeded" else "",
            "reason": "PodDeleted" if deleting else p.reason,
            "message": p.message,
            "attempts": p.attempts,
            "startTime": rfc3339(p.started) if p.started else "",
            "completionTime": rfc3339(p.finished) if p.finished else "",
            "stepSeconds": p.step_seconds,
            "outOfTrafficSeconds": traffic.pod_seconds(p),
            "probe": p.probe,
        }
    )


def _worst_first(phase: str, name: str) -> tuple[int, str]:
    return ATTENTION[phase], name


def _pod_results(
    pods: Sequence[PodView],
    refit: RefitView,
    old: Sequence[PodResult],
    vanished: frozenset[str] = frozenset(),
) -> tuple[list[PodResult], int]:
    """(status.pods, status.podsOmitted): the pods that need attention, worst first, capped
    at api.STATUS_PODS_LIMIT, and how many more there are."""
    seen = {p.name for p in pods}
    mine: dict[str, tuple[str, PodView]] = {}  # name -> (phase, pod)
    for pod in pods:
        p = pod.progress
        if p is not None and p.uid == refit.uid:
            mine[pod.name] = (pod_phase(p, pod.deleting), pod)
    # Ranked first, made into entries only within the limit: a 10,000-pod AllAtOnce refit has
    # 10,000 pods in progress.
    ranked: list[tuple[tuple[int, str], PodView | PodResult]] = [
        (_worst_first(phase, name), pod)
        for name, (phase, pod) in mine.items()
        if phase in ATTENTION
    ]
    # A pod now in another refit's hands keeps the result this refit recorded for it while
    # that result needs attention.
    ranked += [
        (_worst_first(r.phase, r.name), r)
        for r in old
        if r.name in seen and r.name not in mine and r.phase in ATTENTION
    ]
    # A pod that vanished mid-pass is kept, Dropped, with its reason (while within the limit:
    # the status is its only record).
    for r in old:
        if r.name not in seen and r.phase in ATTENTION:
            if r.phase != "Dropped":
                update = {"phase": "Dropped", "reason": "PodDeleted", "message": _DELETED}
                r = r.model_copy(update=update)
            ranked.append((_worst_first("Dropped", r.name), r))
    listed = {key[1] for key, _ in ranked}
    for n in sorted(vanished - listed - seen):
        gone = PodResult(name=n, phase="Dropped", reason="PodDeleted", message=_DELETED)
        ranked.append((_worst_first("Dropped", n), gone))
    ranked.sort(key=lambda t: t[0])
    out = []
    for _, x in ranked[:STATUS_PODS_LIMIT]:
        if isinstance(x, PodResult):
            out.append(x)
        else:
            assert x.progress is not None
            out.append(pod_result(x.name, x.progress, x.deleting))
    return out, max(len(ranked) - STATUS_PODS_LIMIT, 0)


def _summary(
    pods: Sequence[PodView],
    refit: RefitView,
    listed: Sequence[PodResult],
    before: ProbeSummary | None = None,
) -> ProbeSummary:
    """Probe results over every pod this refit probed: each pod's record (its progress), and
    the listed results of pods no longer in this refit's hands. Never fewer probes than
    ``before`` (the summary already written; None while rolling back, when the rollback's
    probes replace the forward ones): a pod that moved on to a newer refit, left the fleet or
    is being re-probed no longer shows this refit's probe, and its result still counts."""
    mine = set()
    probes = []
    for pod in pods:
        p = pod.progress
        if p is None or p.uid != refit.uid:
            continue
        mine.add(pod.name)
        if p.probe is not None:
            probes.append(PodProbe.model_validate(p.probe))
    probes += [r.probe for r in listed if r.name not in mine and r.probe is not None]
    if before is not None and len(probes) < before.passed + before.failed + before.inconclusive:
        return before.model_copy()
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


def fleet_results(
    listed: Sequence[PodResult], pods: Sequence[PodView], uid: str
) -> list[PodResult]:
    """Every pod of one refit by name, for people (`kubectl refit status`, the report): the
    pods of the fleet as listed now, each from its own record (its progress annotation, when
    that is the pass of refit ``uid``), folded with the refit's status.pods (``listed``),
    which alone remembers pods that left the fleet and the live step of a pass in flight. A
    pod whose record is another refit's (not reached yet, or moved on since) is Pending."""
    by_name = {r.name: r for r in listed}
    out = []
    for pod in pods:
        p = pod.progress
        entry = by_name.pop(pod.name, None)
        if p is not None and p.uid == uid and (p.outcome or entry is None):
            out.append(pod_result(pod.name, p, pod.deleting))
        elif entry is not None:
            out.append(entry)
        else:
            out.append(PodResult(name=pod.name, phase="Pending", step=""))
    out += by_name.values()
    return sorted(out, key=lambda r: r.name)


def pod_phases(listed: Sequence[PodResult], pods: Sequence[PodView], uid: str) -> dict[str, int]:
    """How many pods of refit ``uid`` are in each status phase, counted over every pod (the
    refit_pods gauge): those whose record is this refit's pass, and those status.pods
    (``listed``) remembers; pods this refit has not reached are not counted."""
    by_name = {r.name: r.phase for r in listed}
    counts: dict[str, int] = {}
    for pod in pods:
        p = pod.progress
        entry = by_name.pop(pod.name, None)
        if p is not None and p.uid == uid and (p.outcome or entry is None):
            phase = pod_phase(p, pod.deleting)
        elif entry is not None:
            phase = entry
        else:
            continue
        counts[phase] = counts.get(phase, 0) + 1
    for phase in by_name.values():
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def peer_nlls(pods: Sequence[PodView], version: str) -> list[float]:
    """NLLs of pods that passed their probe at ``version`` (cross-pod agreement)."""
    out = []
    for pod in pods:
        p = pod.progress
        if p and p.version == version and p.probe and p.probe.get("verdict") == "Pass":
            out.append(float(p.probe.get("nll", 0.0)))
    return out


def decide(obs: Observed) -> Decision:
    d = _decide(obs)
    starting = {s.pod for s in d.start}
    for p in obs.pods:
        if not p.ready or p.progress is None or p.name in obs.in_flight or p.claim is not None:
            continue  # a claimed pod is its pass's
        if p.progress.restarts != p.restarts:
            d.withdraw[p.name] = ("ContainerRestarted", _RESTARTED)
        elif p.name not in starting and foreign(p, obs.fleet, obs.refits):
            # A pass starting now takes it out in its first write.
            d.withdraw[p.name] = ("FleetChanged", (
                f"the pod's labels moved it out of the fleet of refit {p.progress.refit}, "
                f"whose weights ({p.progress.version}) it serves; out of traffic until a pass "
                "of its fleet's refit"))  # fmt: skip
    if obs.refit.spec.broadcast is not None:
        _receivers(d.status, obs)
    return d


_RESTARTED = (
    "the container restarted and lost the weights its pass loaded; out of traffic until a "
    "pass brings it back"
)
RECEIVERS_READY = "ReceiversReady"
# The reason of a refit Superseded because every pod moved on to a newer refit that Succeeded
# (the fleet served its version; index.py keeps it as a rollback candidate).
MOVED_ON = "PodsMovedOn"


def _receivers(st: WeightRefitStatus, obs: Observed) -> None:
    """status.broadcast and the ReceiversReady condition the trainer waits for: True while a
    round's pods wait for the trainer's send (docs/broadcast.md, "A broadcast refit")."""
    b = obs.refit.spec.broadcast
    assert b is not None
    if obs.broadcast is not None:
        st.broadcast = obs.broadcast
    elif st.broadcast is not None and st.broadcast.state in ("Ready", "Sending"):
        # The operator restarted: no pod waits in that round any more (a resumed pass joins
        # a new one), so the trainer must not send it.
        st.broadcast = st.broadcast.model_copy(update={"state": "Done"})
    r = st.broadcast
    where = f"{b.rendezvous.host}:{b.rendezvous.port}"
    if st.phase in TERMINAL_PHASES:
        ready, reason, message = False, "RefitFinished", f"the refit is {st.phase}"
    elif r is None:
        ready, reason, message = False, "NoRound", "no pods on their way to a transfer yet"
    elif r.state in ("Ready", "Sending"):
        ready, reason = True, RECEIVERS_READY
        message = (
            f"round {r.round}: {r.receivers} pods at ranks 1-{r.world_size - 1} wait for the "
            f"trainer (rank 0 of world size {r.world_size}) at {where}"
        )
    elif r.state == "Done":
        ready, reason = False, "RoundDone"
        message = f"round {r.round} received; no pods waiting for a send"
    else:
        ready, reason = False, "Joining"
        message = f"round {r.round}: {r.receivers} pods on their way to the transfer"
    status: Literal["True", "False"] = "True" if ready else "False"
    old = next((c for c in obs.refit.status.conditions if c.type == RECEIVERS_READY), None)
    changed = old is None or old.status != status
    condition = Condition(
        type=RECEIVERS_READY, status=status, reason=reason, message=message,
        last_transition_time=rfc3339(obs.now) if changed or old is None
        else old.last_transition_time,
        observed_generation=obs.refit.generation,
    )  # fmt: skip
    st.conditions = [c for c in st.conditions if c.type != RECEIVERS_READY] + [condition]


def _decide(obs: Observed) -> Decision:
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
    role = plan.queue_role(me, obs.fleet)  # obs.fleet: the refits sharing pods with this one
    if role.role == "superseded":
        transition("Superseded", "Superseded", f"superseded by {role.superseded_by} (LatestWins)")
        d.idle = True
        d.release_finalizer = refit.deleting
        return d
    if role.role == "queued":
        st.queue_position = role.position
        ahead = f" ({role.position} in line)" if role.position > 1 else ""
        transition(
            "Queued",
            "Queued",
            f"waiting for {role.waiting_for}, which selects pods of this refit{ahead}",
        )
        d.idle = True
        d.release_finalizer = refit.deleting
        return d
    st.queue_position = 0

    states_for = {
        pod.name: pod_state(
            pod, refit, spec.version, False, obs.refits, elsewhere=obs.elsewhere, fleet=obs.fleet
        )
        for pod in obs.pods
    }
    back = _back(obs, states_for) if _superseded_by_pods(old) else []
    if back:
        # Its pods had all moved on to a newer refit that Succeeded; some are back (that
        # refit was deleted, or the pod restarted or moved since): it is their target again.
        shown = _names(back)
        transition("Succeeded", "Succeeded", f"the target again of {shown}, which no newer "
                   "refit answers for")  # fmt: skip
    elif st.phase in TERMINAL_PHASES and st.phase != "Succeeded":
        d.idle = True  # a finished refit's record stays as it was written
        d.release_finalizer = refit.deleting
        # Superseded because its pods moved on: it watches the pods it would be the target
        # of, were they back, so that it takes them up at once.
        d.watching = _superseded_by_pods(old) and bool(_orphans(obs))
        return d
    st.pods, st.pods_omitted = _pod_results(obs.pods, refit, old.pods, obs.vanished)
    st.probe_summary = _summary(
        obs.pods, refit, st.pods, None if st.phase == "RollingBack" else old.probe_summary
    )
    mine = [(p.name, p.progress) for p in obs.pods if p.progress and p.progress.uid == refit.uid]
    st.out_of_traffic = traffic.summarize_out_of_traffic(
        mine, None if st.phase == "RollingBack" else old.out_of_traffic
    )

    # ---- deletion: finish what is in flight, start nothing new, then let go
    if refit.deleting:
        active = [n for n, s in states_for.items() if s == "active"]
        d.start = [_resume(n, obs, refit) for n in active if n not in obs.in_flight]
        # Another operator process's pass of this refit holds the finalizer too: deleting
        # the refit would stop that pass mid-step.
        theirs = any(p.name in obs.elsewhere and p.claim and p.claim.uid == refit.uid
                     for p in obs.pods)  # fmt: skip
        d.release_finalizer = not active and not obs.in_flight and not theirs
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
        problem = preflight_problem(
            obs.pods, obs.preflight, spec.allow_unsafe_backends, spec.sequence.sleep_level
        )
        st.target_pods = len(obs.pods)
        if problem is not None:
            transition("Failed", problem[0], problem[1], "Warning")
            d.idle = True
            return d
        st.sequence = spec.sequence.model_copy()  # what this preflight admitted the pods for
        transition(
            "Progressing",
            "Progressing",
            f"refitting {len(obs.pods)} pods to {spec.version}",
        )

    if st.phase in ("Progressing", "Succeeded"):
        _progress(obs, d, states_for, transition)
    elif st.phase == "RollingBack":
        _rollback(obs, d, transition)
    else:
        d.idle = True
    return d


def _superseded_by_pods(st: WeightRefitStatus) -> bool:
    ready = next((c for c in st.conditions if c.type == "Ready"), None)
    return st.phase == "Superseded" and ready is not None and ready.reason == MOVED_ON


def _orphans(obs: Observed) -> list[PodView]:
    """The pods of this refit's fleet that no newer Succeeded refit selects: were this refit
    Succeeded, it would be their target."""
    refit = obs.refit
    me = plan.RefitRef(refit.name, refit.created, "Succeeded", refit.spec.queue_policy)
    newer = [r for r in obs.fleet if r.phase == "Succeeded" and plan.newer(r, me)]
    return [p for p in obs.pods if not p.deleting and not any(r.selects(p.labels) for r in newer)]


def _back(obs: Observed, states: Mapping[str, plan.PodState]) -> list[str]:
    """Pods this refit would be the target of that no newer refit answers for any more."""
    others = ("superseded", "dropped", "blocked")
    return sorted(p.name for p in _orphans(obs) if states[p.name] not in others)


def _names(names: Sequence[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(sorted(names)[:shown]) + more


def _resume(name: str, obs: Observed, refit: RefitView) -> PodStart:
    pod = next(p for p in obs.pods if p.name == name)
    assert pod.progress is not None
    p = pod.progress
    return PodStart(name, p.version, p.path, p.rollback, resume=True)


def _count(st: WeightRefitStatus, states: dict[str, plan.PodState]) -> None:
    """Counts over the pods this refit answers for (dropped and superseded ones left out)."""
    st.target_pods = len(states)
    st.updated_pods = sum(s == "passed" for s in states.values())
    st.failed_pods = sum(s in ("failed", "dropped") for s in states.values())
    st.inconclusive_pods = sum(s == "inconclusive" for s in states.values())


def _progress(
    obs: Observed, d: Decision, states: dict[str, plan.PodState], transition: Transition
) -> None:
    refit, spec, st = obs.refit, obs.refit.spec, d.status
    # Dropped pods (deleted mid-refit) leave the fleet: recorded in status.pods, not counted.
    # Superseded pods (a newer refit drove them) are that refit's to answer for.
    moved_on = sorted(n for n, s in states.items() if s == "superseded")
    states = {n: s for n, s in states.items() if s not in ("dropped", "superseded")}
    _count(st, states)
    newest = _newest_driver(obs, moved_on) if moved_on else ""
    if (
        not states
        and not obs.in_flight
        and any(r.name == newest and r.phase == "Succeeded" for r in obs.fleet)
    ):
        # Only a newer refit that Succeeded takes over: pods it failed on, or rolled back,
        # leave this one the fleet's last good version (and rollback target).
        transition("Superseded", MOVED_ON, f"every pod of this refit moved on to {newest}")
        d.idle = True
        return
    resumes = [
        _resume(n, obs, refit)
        for n, s in states.items()
        if s == "active" and n not in obs.in_flight
    ]
    held = _held(obs, states)
    if st.phase == "Succeeded":
        # The counts as they are now: pods join, restart, move in and out of the fleet.
        st.message = _succeeded_message(st, spec, moved_on)
        # Convergence: a finished refit brings late or restarted pods to its version, unless
        # a refit that shares pods with it is at work, and only pods no newer Succeeded refit
        # selects (that one converges them): two finished refits never fight over a pod.
        if any(r.phase not in TERMINAL_PHASES for r in obs.fleet if r.name != refit.name):
            d.idle = True
            return
        orphans = {p.name for p in _orphans(obs)}
        targets = [n for n in states if n in orphans]
        # It watches while it is the target of any pod, also of pods a newer refit that did
        # not succeed drove (those that passed keep its version): one that restarts or moves
        # is this refit's to converge, at once.
        d.watching = bool(orphans)
        if not targets and not resumes:
            d.idle = True  # nothing to converge: newer refits answer for every pod
            return
        # A broadcast left nothing to load its version from: a pod that joins later waits
        # (out of traffic) for the next refit.
        fresh = [] if spec.broadcast is not None else targets
        ready = _startable(obs)
        moved = _foreign(obs)
        d.start = resumes + [
            _fresh(n, spec, n not in moved) for n in fresh if states[n] == "todo" and n in ready
        ]
        d.idle = not d.start and not obs.in_flight
        d.watching = True
        return
    if held:
        st.message = f"waiting for {held}"

    started = _started(st)
    timed_out = started is not None and obs.now - started > spec.sequence.total_timeout_seconds
    g = plan.gate(states, spec.probe)
    if timed_out and not g.tripped:
        limit = spec.sequence.total_timeout_seconds
        g = plan.Gate(True, "TotalTimeoutExceeded", f"the refit ran past {limit}s")
    if not g.tripped:
        starts = plan.next_pods(states, spec.strategy)
        ready = _startable(obs)
        moved = _foreign(obs)
        d.start = resumes + [_fresh(n, spec, n not in moved) for n in starts if n in ready]
        if spec.checkpoint is not None:  # a broadcast has nothing to stage
            vetted = {p.name for p in obs.pods if p.vetted}  # staging sends the admin token
            d.stage_ahead = [
                n for n in plan.stage_ahead(states, spec.strategy, starts) if n in vetted
            ]
        if plan.all_settled(states) and not obs.in_flight and not d.start:
            transition("Succeeded", "Succeeded", _succeeded_message(st, spec, moved_on))
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
    msg = f"{g.message}; rolling each pod back to the checkpoint it served"
    transition("RollingBack", g.reason, msg, "Warning")
    _rollback(obs, d, transition)


def _succeeded_message(st: WeightRefitStatus, spec: WeightRefitSpec, moved_on: list[str]) -> str:
    msg = f"{st.updated_pods}/{st.target_pods} pods at {spec.version}"
    degraded = st.failed_pods + st.inconclusive_pods
    if degraded:
        msg += f"; {degraded} failed or inconclusive within the limits"
    if moved_on:
        msg += f"; {len(moved_on)} moved on to newer refits"
    return msg


def _newest_driver(obs: Observed, names: list[str]) -> str:
    """The newest refit among those that last drove the named pods."""
    drivers = [p.progress for p in obs.pods if p.name in names and p.progress is not None]
    newest = max(drivers, key=lambda p: times.order_key(p.created, p.refit), default=None)
    return newest.refit if newest else ""


def _held(obs: Observed, states: dict[str, plan.PodState]) -> str:
    """'pods a, b held by refit x' for the pods another refit's pass holds ("" if none)."""
    by: dict[str, list[str]] = {}
    for pod in obs.pods:
        if states.get(pod.name) == "blocked":
            by.setdefault(holder(pod, obs.refit, obs.refits, obs.elsewhere), []).append(pod.name)
    parts = []
    for other, names in sorted(by.items()):
        shown = ", ".join(sorted(names)[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
        parts.append(f"pod(s) {shown} held by a pass of refit {other}")
    return "; ".join(parts)


def _started(st: WeightRefitStatus) -> float | None:
    if not st.start_time:
        return None
    return times.epoch(st.start_time)


def _startable(obs: Observed) -> frozenset[str]:
    """Pods a new pass may begin on now; the others (a container starting or restarting) stay
    to do until the kubelet reports them ready."""
    return frozenset(p.name for p in obs.pods if p.startable)


def _foreign(obs: Observed) -> frozenset[str]:
    """Pods serving another fleet's weights (see ``foreign``)."""
    return frozenset(p.name for p in obs.pods if foreign(p, obs.fleet, obs.refits))


def _fresh(name: str, spec: WeightRefitSpec, keep_serving: bool = True) -> PodStart:
    return PodStart(name, spec.version, spec.path, False, False, keep_serving)


def rollback_targets(
    pods: Sequence[PodView], refit: RefitView
) -> tuple[dict[str, tuple[str, str]], list[str], list[str]]:
    """Where a rollback takes each pod this refit touched, from the pod's own record: (pod ->
    (version, path) of the checkpoint it served when this refit's pass began, or its rollback
    pass goes to; pods whose pass left them serving what they served, nothing to undo; pods
    with no checkpoint to go back to: they served nothing probed, or a broadcast)."""
    to: dict[str, tuple[str, str]] = {}
    kept, nothing = [], []
    for pod in pods:
        p = pod.progress
        if p is None or p.uid != refit.uid or pod.deleting:
            continue
        if p.rollback:
            to[pod.name] = (p.version, p.path)
        elif p.finished_pass and p.in_traffic and p.restarts == pod.restarts and pod.ready:
            kept.append(pod.name)  # refused before its weights were touched
        elif p.serving and p.serving_path:
            to[pod.name] = (p.serving, p.serving_path)
        else:
            nothing.append(pod.name)
    return to, sorted(kept), sorted(nothing)


_NOTHING_BACK = (
    "refit {refit} rolled back, and this pod served no checkpoint before it (nothing probed, "
    "or a broadcast): out of traffic until the next refit"
)


def _rollback(obs: Observed, d: Decision, transition: Transition) -> None:
    """Every pod this refit touched goes back to the checkpoint it served, and is probed; a
    pod with none to go back to leaves traffic (fail closed) and waits for the next refit."""
    refit = obs.refit
    to, kept, nothing = rollback_targets(obs.pods, refit)
    by_name = {p.name: p for p in obs.pods}
    states = {
        n: pod_state(by_name[n], refit, version, True, obs.refits, elsewhere=obs.elsewhere)
        for n, (version, _) in to.items()
    }
    d.start = [
        _resume(n, obs, refit)
        for n, s in states.items()
        if s == "active" and n not in obs.in_flight
    ] + [
        PodStart(n, to[n][0], to[n][1], rollback=True, resume=False)
        for n, s in states.items()
        if s == "todo" and n in _startable(obs)
    ]
    for n in nothing:
        pod = by_name[n]
        if pod.ready and pod.claim is None and n not in obs.in_flight:
            d.withdraw[n] = ("NoRollbackTarget", _NOTHING_BACK.format(refit=refit.name))
    # Finished once those are out of traffic: a finished refit withdraws nothing more.
    if plan.all_settled(states) and not obs.in_flight and not d.start and not d.withdraw:
        bad = sorted(n for n, s in states.items() if s != "passed")
        versions: dict[str, list[str]] = {}
        for n in [n for n, s in states.items() if s == "passed"]:
            versions.setdefault(to[n][0], []).append(n)
        parts = [
            f"{len(ns)} pods rolled back to {v} ({_names(ns)})"
            for v, ns in sorted(versions.items())
        ]
        if kept:
            parts.append(f"{len(kept)} pods kept what they served ({_names(kept)})")
        if bad:
            parts.insert(0, f"rollback failed on {_names(bad)}")
        if nothing:
            parts.insert(len(bad) > 0, (
                f"{len(nothing)} pods had no checkpoint to go back to, out of traffic "
                f"({_names(nothing)})"))  # fmt: skip
        msg = "; ".join(parts) or "no pod to roll back"
        if bad or nothing:
            transition("Failed", "RollbackFailed" if bad else "NoRollbackTarget", msg, "Warning")
        else:
            transition("RolledBack", "RolledBack", msg, "Warning")
        d.idle = True
