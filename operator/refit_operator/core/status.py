"""A WeightRefit's status as people and alerts read it, rendered from the pods' records:
the conditions (Ready, Progressing, Degraded; a broadcast's ReceiversReady, with
status.broadcast), status.pods (the pods that need attention, capped), the probe summary, the
agreed checksums, the time out of traffic, and the per-pod views that `kubectl refit
status`, the report and the metrics share. Pure, like the decision it serves (decision.py
decides; this says)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal

from . import checksums, traffic
from .api_spec import Broadcast
from .api_status import (
    STATUS_PODS_LIMIT,
    TERMINAL_PHASES,
    BroadcastRound,
    Condition,
    Phase,
    PodPhase,
    PodProbe,
    PodResult,
    ProbeSummary,
    WeightRefitStatus,
)
from .podflow import Progress
from .podview import PodView
from .reasons import Reason
from .sequences import Step
from .times import rfc3339

# A status change that only moves progress (the pods' entries and counts, the summaries, the
# agreed checksums, messages, a condition turning False) is written at most this often; what
# someone waits on is written at once (write_now). A tick comes at least this often while pods
# move (handlers.ACTIVE_INTERVAL), so a held-back change is written by the next one.
PROGRESS_WRITE_SECONDS: Final = 1.0


def write_now(new: WeightRefitStatus, old: WeightRefitStatus) -> bool:
    """Whether a changed status is written at once rather than with the progress it holds
    back: a new phase or generation (`kubectl wait` on the phase, a finished refit), a
    condition that turns True (`kubectl wait --for=condition`, Degraded when a pod fails), and
    a broadcast round that turns Ready (the trainer waits on it: under Rolling the next
    round's ReceiversReady may follow a held-back Done, True to True), and a pod dropped from
    the fleet. Everything else is progress."""
    if new.phase != old.phase or new.observed_generation != old.observed_generation:
        return True
    if new.phase in TERMINAL_PHASES:
        return True  # rare, and a finished refit's ticks are minutes apart
    b, was = new.broadcast, old.broadcast
    if (
        b is not None
        and b.state == "Ready"
        and (was is None or (was.round, was.state) != (b.round, "Ready"))
    ):
        return True
    # A pod that left the fleet (deleted, deselected) has no record left to render it from:
    # only the status remembers it, so the tick that saw it go writes it.
    gone = {p.name for p in old.pods if p.phase == "Dropped"}
    if any(p.phase == "Dropped" and p.name not in gone for p in new.pods):
        return True
    before = {c.type: c.status for c in old.conditions}
    return any(c.status == "True" and before.get(c.type) != "True" for c in new.conditions)


def _condition(
    ctype: str,
    value: bool,
    reason: str,
    message: str,
    old: Sequence[Condition],
    now: float,
    generation: int,
) -> Condition:
    """A condition of the refit; its transition time moves only when its status does."""
    status: Literal["True", "False"] = "True" if value else "False"
    prev = next((c for c in old if c.type == ctype), None)
    changed = prev is None or prev.status != status
    return Condition(
        type=ctype,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=rfc3339(now) if changed or prev is None else prev.last_transition_time,
        observed_generation=generation,
    )


def conditions(
    phase: Phase,
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
    why_degraded = Reason.PodsFailedWithinLimits if ready else reason
    wanted = [
        ("Ready", ready, reason if not ready else "Succeeded"),
        ("Progressing", progressing, reason if progressing else phase),
        ("Degraded", degraded, why_degraded if degraded else Reason.AsExpected),
    ]
    return [
        _condition(ctype, value, why or phase, message, old, now, generation)
        for ctype, value, why in wanted
    ]


# The condition the trainer waits for is named as its True reason.
RECEIVERS_READY = Reason.ReceiversReady


def receivers(
    st: WeightRefitStatus,
    broadcast: Broadcast,
    observed: BroadcastRound | None,
    old: Sequence[Condition],
    now: float,
    generation: int,
) -> None:
    """A broadcast refit's status.broadcast (its current round, ``observed`` by the engine's
    rounds; None: no round yet) and the ReceiversReady condition the trainer waits for: True
    while a round's pods wait for the trainer's send (docs/broadcast.md, "A broadcast
    refit"). ``old``: the conditions the status had before this reconcile."""
    if observed is not None:
        st.broadcast = observed
    elif st.broadcast is not None and st.broadcast.state in ("Ready", "Sending"):
        # The operator restarted: no pod waits in that round any more (a resumed pass joins
        # a new one), so the trainer must not send it.
        st.broadcast = st.broadcast.model_copy(update={"state": "Done"})
    r = st.broadcast
    where = f"{broadcast.rendezvous.host}:{broadcast.rendezvous.port}"
    if st.phase in TERMINAL_PHASES:
        ready, reason, message = False, Reason.RefitFinished, f"the refit is {st.phase}"
    elif r is None:
        ready, reason, message = False, Reason.NoRound, "no pods on their way to a transfer yet"
    elif r.state in ("Ready", "Sending"):
        ready, reason = True, RECEIVERS_READY
        message = (
            f"round {r.round}: {r.receivers} pods at ranks 1-{r.world_size - 1} wait for the "
            f"trainer (rank 0 of world size {r.world_size}) at {where}"
        )
    elif r.state == "Done":
        ready, reason = False, Reason.RoundDone
        message = f"round {r.round} received; no pods waiting for a send"
    else:
        ready, reason = False, Reason.Joining
        message = f"round {r.round}: {r.receivers} pods on their way to the transfer"
    condition = _condition(RECEIVERS_READY, ready, reason, message, old, now, generation)
    st.conditions = [c for c in st.conditions if c.type != RECEIVERS_READY] + [condition]


# status.pods lists only the pods that need a person's attention, worst first (rank, then
# name). A pod that succeeded or rolled back is not listed: its record is its progress
# annotation, so the WeightRefit stays small at any fleet size (api_status.STATUS_PODS_LIMIT).
ATTENTION: Final[Mapping[PodPhase, int]] = {
    "Failed": 0,
    "Inconclusive": 1,
    "Dropped": 2,
    "InProgress": 3,
}
_DELETED = "the pod was deleted mid-refit"


def pod_phase(p: Progress, deleting: bool = False) -> PodPhase:
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
            "step": p.step if p.step else Step.ready,
            "version": p.version if p.outcome == "Succeeded" else "",
            "reason": Reason.PodDeleted if deleting else p.reason,
            "message": p.message,
            "attempts": p.attempts,
            "startTime": rfc3339(p.started) if p.started else "",
            "completionTime": rfc3339(p.finished) if p.finished else "",
            "stepSeconds": p.step_seconds,
            "outOfTrafficSeconds": traffic.pod_seconds(p),
            "probe": p.probe,
            "checksum": p.checksum,
        }
    )


def _worst_first(phase: PodPhase, name: str) -> tuple[int, str]:
    return ATTENTION[phase], name


def pod_results(
    pods: Sequence[PodView],
    uid: str,
    old: Sequence[PodResult],
    vanished: frozenset[str] = frozenset(),
) -> tuple[list[PodResult], int]:
    """(status.pods, status.podsOmitted): the pods that need attention, worst first, capped
    at api_status.STATUS_PODS_LIMIT, and how many more there are."""
    seen = {p.name for p in pods}
    mine: dict[str, tuple[PodPhase, PodView]] = {}  # name -> (phase, pod)
    for pod in pods:
        p = pod.progress
        if p is not None and p.uid == uid:
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
                update = {"phase": "Dropped", "reason": Reason.PodDeleted, "message": _DELETED}
                r = r.model_copy(update=update)
            ranked.append((_worst_first("Dropped", r.name), r))
    listed = {key[1] for key, _ in ranked}
    for n in sorted(vanished - listed - seen):
        gone = PodResult(name=n, phase="Dropped", reason=Reason.PodDeleted, message=_DELETED)
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


def probe_summary(
    pods: Sequence[PodView],
    uid: str,
    listed: Sequence[PodResult],
    before: ProbeSummary | None = None,
) -> ProbeSummary:
    """Probe results over every pod this refit probed: each pod's record (its progress), and
    the listed results of pods no longer in this refit's hands. Never fewer probes than
    ``before`` (the summary already written; None while rolling back, when the rollback's
    probes replace the forward ones): a pod that moved on to a newer refit, left the fleet or
    is being re-probed no longer shows this refit's probe, and its result still counts."""
    mine = set()
    probes: list[PodProbe] = []
    for pod in pods:
        p = pod.progress
        if p is None or p.uid != uid:
            continue
        mine.add(pod.name)
        if p.probe is not None:
            probes.append(p.probe)
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


def from_records(
    st: WeightRefitStatus,
    old: WeightRefitStatus,
    pods: Sequence[PodView],
    uid: str,
    vanished: frozenset[str] = frozenset(),
) -> None:
    """What the status says of the pods of refit ``uid``, from their records and ``old`` (the
    status before this reconcile): status.pods, the probe summary, the agreed checksums and
    the time out of traffic. While rolling back the rollback's passes replace the forward
    ones: its summaries are made afresh, not kept from before."""
    rolling_back = st.phase == "RollingBack"
    st.pods, st.pods_omitted = pod_results(pods, uid, old.pods, vanished)
    st.probe_summary = probe_summary(
        pods, uid, st.pods, None if rolling_back else old.probe_summary
    )
    mine = [(p.name, p.progress) for p in pods if p.progress and p.progress.uid == uid]
    st.checksums = checksums.status_checksums(old.checksums, [p for _, p in mine], uid)
    st.out_of_traffic = traffic.summarize_out_of_traffic(
        mine, None if rolling_back else old.out_of_traffic
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
        if p and p.version == version and p.probe and p.probe.verdict == "Pass":
            out.append(p.probe.nll)
    return out
