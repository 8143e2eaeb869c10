"""The decision of one reconcile of one WeightRefit, pure: what the cluster looks like in,
decisions out.

Read it top to bottom: queue → preflight → progress (strategy, gate) → rollback → finish.
The caller (controller/reconcile_loop.py) gathers the observations, runs the I/O this asks
for, and feeds the results back on the next call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from . import plan, times
from .admission import PreflightResult, fleet_layout, preflight_problem, spec_problem
from .api import (
    TERMINAL_PHASES,
    BroadcastRound,
    Phase,
    Previous,
    WeightRefitSpec,
    WeightRefitStatus,
)
from .gate import base_moved_on, gate
from .pod_state import RefitView, foreign, holder, pod_state
from .podview import PodView
from .reasons import Problem, Reason
from .sequences import FLOWS
from .status import conditions, from_records, receivers
from .times import rfc3339

# A Succeeded refit tries a pod its pass failed on (or judged inconclusive) again this long
# after that pass ended: a pod out of traffic for a fault that has passed (a read-back that
# differed once, a crash mid-probe) comes back, and one that keeps failing costs a pass a
# minute, each with its Warning Event.
RETRY_FAILED_SECONDS = 60.0


class Transition(Protocol):
    def __call__(self, phase: Phase, reason: str, message: str, etype: str = "Normal") -> None: ...


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
    # The uids of refits that claim pods here and exist, which this process's watch has not
    # shown yet (not in ``refits``): their claims hold the pods as a known refit's do.
    unseen: frozenset[str] = frozenset()


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
    withdraw: dict[str, Problem] = field(default_factory=dict)

    @property
    def dormant(self) -> bool:
        """Finished and not the fleet's target: nothing will happen soon."""
        return self.status.phase in TERMINAL_PHASES and not self.watching


def decide(obs: Observed) -> Decision:
    d = _decide(obs)
    starting = {s.pod for s in d.start}
    for p in obs.pods:
        if not p.any_ready or p.name in obs.in_flight or p.claim is not None:
            continue  # a claimed pod is its pass's
        # Withdrawal waits for no pass: whatever any track's record or any member of a group
        # says, a unit in traffic that the gate holds out leaves traffic now.
        held = gate(p)
        if not held.ready:
            d.withdraw[p.name] = Problem(held.reason, held.message)
        elif p.progress is None:
            continue
        elif p.name not in starting and foreign(p, obs.fleet, obs.refits):
            # A pass starting now takes it out in its first write.
            d.withdraw[p.name] = Problem(Reason.FleetChanged, (
                f"the pod's labels moved it out of the fleet of refit {p.progress.refit}, "
                f"whose weights ({p.progress.version}) it serves; out of traffic until a pass "
                "of its fleet's refit"))  # fmt: skip
    refit = obs.refit
    if refit.spec.broadcast is not None:  # a broadcast's own status: its rounds' receivers
        receivers(
            d.status, refit.spec.broadcast, obs.broadcast, refit.status.conditions, obs.now,
            refit.generation,
        )  # fmt: skip
    return d


def _decide(obs: Observed) -> Decision:
    refit, spec = obs.refit, obs.refit.spec
    old = obs.refit.status
    st = old.model_copy(deep=True)
    st.observed_generation = refit.generation
    st.fleet = spec.fleet.selector.canonical()
    d = Decision(status=st)

    def transition(phase: Phase, reason: str, message: str, etype: str = "Normal") -> None:
        if st.phase != phase or st.message != message:
            d.events.append(Event(reason, message, etype))
        st.phase = phase
        st.message = message
        if phase in TERMINAL_PHASES and not st.completion_time:
            st.completion_time = rfc3339(obs.now)
        tolerated = st.failed_pods + st.inconclusive_pods if phase == "Succeeded" else 0
        st.conditions = conditions(
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
            pod,
            refit,
            spec.version,
            False,
            obs.refits,
            elsewhere=obs.elsewhere,
            fleet=obs.fleet,
            unseen=obs.unseen,
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
        # Its own passes cut short (an operator died mid-pass) finish, as they would have had
        # it lived: their claims are what the fleet's other refits wait for.
        d.start = [_resume(n, obs, refit) for n, s in states_for.items()
                   if s == "active" and n not in obs.in_flight]  # fmt: skip
        d.idle = not d.start  # a finished refit's record stays as it was written
        d.release_finalizer = refit.deleting
        # Superseded because its pods moved on: it watches the pods it would be the target
        # of, were they back, so that it takes them up at once.
        d.watching = _superseded_by_pods(old) and bool(_orphans(obs))
        return d
    from_records(st, old, obs.pods, refit.uid, obs.vanished)

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
        problem = spec_problem(spec)
        if problem is not None:  # nothing is asked of any pod
            transition("Failed", problem.reason, problem.message, "Warning")
            d.idle = True
            return d
        if obs.preflight is None:
            d.need_preflight = True
            return d
        problem = preflight_problem(
            obs.pods, obs.preflight, spec.allow_unsafe_backends, spec.sequence.sleep_level,
            adapter=not FLOWS[spec.source].reloads,
        )  # fmt: skip
        st.target_pods = len(obs.pods)
        if problem is not None:
            transition("Failed", problem.reason, problem.message, "Warning")
            d.idle = True
            return d
        st.sequence = spec.sequence.model_copy()  # what this preflight admitted the pods for
        st.layout = fleet_layout(obs.preflight.infos)  # ... and the layout it found them in
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
    return st.phase == "Superseded" and ready is not None and ready.reason == Reason.PodsMovedOn


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


def _retry_due(obs: Observed, names: Sequence[str]) -> set[str]:
    """Those of ``names`` (pods this Succeeded refit's pass failed on) whose pass ended at
    least RETRY_FAILED_SECONDS ago."""
    if not names:
        return set()  # the common case: no pass over every pod on a watching tick
    ended = {p.name: p.progress.finished for p in obs.pods if p.progress is not None}
    return {n for n in names if 0 < ended.get(n, 0) <= obs.now - RETRY_FAILED_SECONDS}


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
    rebased = [n for n in moved_on if base_moved_on(_pod(obs, n), _pod(obs, n).progress)]
    if not states and not obs.in_flight and rebased and len(rebased) == len(moved_on):
        base = _pod(obs, rebased[0]).records[""]
        transition("Superseded", Reason.BaseChanged, (
            f"the base weights of every pod moved on ({_names(rebased)}; {base.refit} serves "
            f"{base.version}) from the base this adapter was probed on: each unloaded it; "
            "refit the adapter for the new base"))  # fmt: skip
        d.idle = True
        return
    if (
        not states
        and not obs.in_flight
        and any(r.name == newest and r.phase == "Succeeded" for r in obs.fleet)
    ):
        # Only a newer refit that Succeeded takes over: pods it failed on, or rolled back,
        # leave this one the fleet's last good version (and rollback target).
        transition(
            "Superseded", Reason.PodsMovedOn, f"every pod of this refit moved on to {newest}"
        )
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
            # Its own passes cut short (an operator died mid-pass) still resume: their claims
            # are what the refit at work waits for.
            d.start = resumes
            d.idle = not resumes and not obs.in_flight
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
        fresh = targets if FLOWS[spec.source].loads_again else []
        ready = _startable(obs)
        moved = _foreign(obs)
        retry = _retry_due(obs, [n for n in fresh if states[n] in ("failed", "inconclusive")])
        d.start = resumes + [
            _fresh(n, spec, n not in moved)
            for n in fresh
            if (states[n] == "todo" or n in retry) and n in ready
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
        g = plan.Gate(True, Reason.TotalTimeoutExceeded, f"the refit ran past {limit}s")
    if not g.tripped:
        starts = plan.next_pods(states, spec.strategy)
        ready = _startable(obs)
        moved = _foreign(obs)
        d.start = resumes + [_fresh(n, spec, n not in moved) for n in starts if n in ready]
        if FLOWS[spec.source].stages_ahead:
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


def _pod(obs: Observed, name: str) -> PodView:
    return next(p for p in obs.pods if p.name == name)


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
            by.setdefault(holder(pod, obs.refit, obs.refits, obs.elsewhere, obs.unseen), []).append(
                pod.name
            )
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
        elif p.finished_pass and p.in_traffic and pod.same_run(p) and pod.ready:
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
        n: pod_state(
            by_name[n],
            refit,
            version,
            True,
            obs.refits,
            elsewhere=obs.elsewhere,
            unseen=obs.unseen,
        )
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
            d.withdraw[n] = Problem(Reason.NoRollbackTarget, _NOTHING_BACK.format(refit=refit.name))
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
            reason = Reason.RollbackFailed if bad else Reason.NoRollbackTarget
            transition("Failed", reason, msg, "Warning")
        else:
            transition("RolledBack", Reason.RolledBack, msg, "Warning")
        d.idle = True
