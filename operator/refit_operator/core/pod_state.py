"""Which state each pod is in for one refit (``pod_state``: to do, active, passed, failed, ...),
and what decides it beside the pod's own record: whose pass holds the pod (``holder``), whether
its weights are another fleet's (``foreign``), whether a newer refit answers for it
(``moved_on``). Pure; the decision (decision.py) and ``kubectl refit plan`` read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from . import plan
from .api_spec import WeightRefitSpec
from .api_status import TERMINAL_PHASES, WeightRefitStatus
from .gate import adapter_missing, base_moved_on
from .podview import PodView


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


def holder(
    pod: PodView,
    refit: RefitView,
    refits: Mapping[str, str],
    elsewhere: Set[str] = frozenset(),
    unseen: Set[str] = frozenset(),
) -> str:
    """Whose pass holds the pod, when it is not this refit's to drive: another refit's, or
    any refit's pass of another operator process that may still act (``elsewhere``), named
    with that process. "" when the pod is free, held by a pass of this refit that this process
    may take over, or held by a refit that no longer exists: a claim outlives only a crashed
    pass. ``unseen``: refits that exist, not yet in ``refits`` (this process's watch lags)."""
    c = pod.claim
    if c is None or (c.uid not in refits and c.uid not in unseen):
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
    # Lost: the weights it left are gone (a restart; for an adapter, also a reload of the
    # base at the same version, which unloaded it).
    lost = p.finished_pass and (not pod.same_run(p) or adapter_missing(pod, p))
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
    unseen: Set[str] = frozenset(),
) -> plan.PodState:
    p = pod.progress
    if pod.deleting:
        return "dropped"
    # A newer refit has driven the pod (or drives it now): it has moved on, and this refit
    # neither counts it nor takes it back (two refits never fight over a pod).
    if moved_on(pod, refit, version, fleet, refits):
        return "superseded"
    if holder(pod, refit, refits or {}, elsewhere, unseen):
        return "blocked"
    if p is not None and p.uid == refit.uid and base_moved_on(pod, p):
        return "superseded"  # an adapter its pod's new base weights unloaded (core/gate.py)
    mine = p is not None and p.uid == refit.uid and p.rollback == rollback and p.version == version
    if not mine or p is None:
        return "passed" if pod.verified(version) and not rollback else "todo"
    if p.outcome == "Succeeded":
        # An adapter the pod lost (a restart, or the base reloaded at the same version) is
        # this refit's to load again.
        return "passed" if pod.same_run(p) and not adapter_missing(pod, p) else "todo"
    if p.outcome in ("Failed", "Inconclusive") and not pod.same_run(p):
        # The container restarted since the pass began: whatever the pass judged, the new
        # process holds none of it (its boot weights), so it is a pod to refit like any
        # restarted one, not a failure that stays.
        return "todo"
    if p.outcome == "Failed":
        return "failed"
    if p.outcome == "Inconclusive":
        return "inconclusive"
    return "active"
