"""Fleet-level decisions, pure: which pods go next, whether the gate holds, which refit of a
fleet is active, and which refit is the fleet's current target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from . import times
from .api_spec import LabelSelector, ProbeSpec, Strategy, max_unavailable_count
from .api_status import TERMINAL_PHASES, Phase
from .reasons import Reason

# Where a pod stands for one refit. "blocked": another refit's pass, or another operator
# process's pass, holds it (wait; out of traffic, so it counts as in flight);
# "superseded": a newer refit has driven it (no longer this refit's to count or to touch).
PodState = Literal[
    "todo", "active", "passed", "failed", "inconclusive", "dropped", "blocked", "superseded"
]

IN_FLIGHT = frozenset({"active", "blocked"})


def _eligible(states: dict[str, PodState], strategy: Strategy) -> tuple[list[str], int]:
    """(pods that may start, in name order; pods in flight). Canaries (the first ``canary``
    pods by name) go first and must all pass before any other pod is eligible."""
    names = sorted(states)
    canaries = names[: min(strategy.canary, len(names))]
    if any(states[n] != "passed" for n in canaries):
        if any(states[n] in ("failed", "inconclusive") for n in canaries):
            return [], 0
        pool = [n for n in canaries if states[n] == "todo"]
        return pool, sum(states[n] in IN_FLIGHT for n in canaries)
    pool = [n for n in names if states[n] == "todo"]
    return pool, sum(s in IN_FLIGHT for s in states.values())


def next_pods(states: dict[str, PodState], strategy: Strategy) -> list[str]:
    """Pods to start now. Canaries go first (see _eligible). AllAtOnce then starts every pod;
    Rolling keeps at most maxUnavailable pods in flight (pods that ended failed do not count:
    with a failureLimit above 0 they would otherwise stall the rollout for good)."""
    pool, in_flight = _eligible(states, strategy)
    if strategy.type == "AllAtOnce":
        return pool
    budget = max_unavailable_count(strategy.max_unavailable, len(states)) - in_flight
    return pool[: max(budget, 0)]


def stage_ahead(
    states: dict[str, PodState], strategy: Strategy, starting: Sequence[str]
) -> list[str]:
    """Rolling: the next batch, the pods that start when pods in flight finish. Their
    checkpoint stages now, while they serve and the current batch is out of traffic, so that
    their own time out of traffic holds only the swap."""
    if strategy.type == "AllAtOnce":
        return []
    pool, _ = _eligible(states, strategy)
    batch = max_unavailable_count(strategy.max_unavailable, len(states))
    return [n for n in pool if n not in starting][:batch]


@dataclass(frozen=True)
class Gate:
    tripped: bool
    reason: str = ""
    message: str = ""


def gate(states: dict[str, PodState], probe: ProbeSpec) -> Gate:
    failed = sum(s == "failed" for s in states.values())
    inconclusive = sum(s == "inconclusive" for s in states.values())
    if failed > probe.failure_limit:
        return Gate(
            True,
            Reason.FailureLimitExceeded,
            f"{failed} pods failed (failureLimit {probe.failure_limit})",
        )
    if inconclusive > probe.inconclusive_limit:
        return Gate(
            True,
            Reason.InconclusiveLimitExceeded,
            f"{inconclusive} pods inconclusive (inconclusiveLimit {probe.inconclusive_limit})",
        )
    return Gate(False)


def all_settled(states: dict[str, PodState]) -> bool:
    return all(s not in ("todo", "active", "blocked") for s in states.values())


@dataclass(frozen=True)
class RefitRef:
    """What queueing needs to know about one WeightRefit of a fleet."""

    name: str
    created: str  # creation order (times.creation_order: sorts in creation order)
    phase: Phase
    queue_policy: str = "Queue"
    selector: LabelSelector | None = None

    def selects(self, labels: dict[str, str]) -> bool:
        return self.selector is not None and self.selector.matches(labels)


@dataclass(frozen=True)
class QueueDecision:
    role: Literal["active", "queued", "superseded", "done"]
    position: int = 0
    superseded_by: str = ""
    waiting_for: str = ""  # queued: the refit that goes first


def _order(r: RefitRef) -> tuple[str, str]:
    return times.order_key(r.created, r.name)


def queue_role(me: RefitRef, fleet: Sequence[RefitRef]) -> QueueDecision:
    """One active refit per fleet: the oldest one not finished. ``fleet`` holds the refits
    that share at least one pod with ``me`` (fleets are compared by the pods they select, not
    by selector text). Later ones wait in creation order. A refit not yet started is
    superseded by any later refit with queuePolicy LatestWins (a refit in progress is never
    abandoned: it finishes or fails)."""
    if me.phase in TERMINAL_PHASES:
        return QueueDecision("done")
    pending = sorted((r for r in fleet if r.phase not in TERMINAL_PHASES), key=_order)
    if all(r.name != me.name for r in pending):
        pending = sorted([*pending, me], key=_order)
    me = next(r for r in pending if r.name == me.name)

    def started(r: RefitRef) -> bool:
        return r.phase not in ("Pending", "Queued")

    def winner(r: RefitRef) -> RefitRef | None:
        later = [w for w in pending if _order(w) > _order(r) and w.queue_policy == "LatestWins"]
        return max(later, key=_order) if later and not started(r) else None

    beaten = winner(me)
    if beaten is not None:
        return QueueDecision("superseded", superseded_by=beaten.name)
    if started(me):
        # Never sent back to the queue: when two started refits come to share pods (labels
        # changed, or both started before either saw the other), the pods' claims take turns.
        return QueueDecision("active")
    live = [r for r in pending if winner(r) is None]
    # A refit already past Queued keeps its turn even if an older one shows up late.
    active = next((r for r in live if started(r)), live[0])
    if active.name == me.name:
        return QueueDecision("active")
    waiting = [r for r in live if r.name != active.name]
    position = 1 + [r.name for r in waiting].index(me.name)
    return QueueDecision("queued", position=position, waiting_for=active.name)


def newer(a: RefitRef, b: RefitRef) -> bool:
    """Whether ``a`` was created after ``b``, in the one creation order (times.order_key)."""
    return _order(a) > _order(b)


def fleet_target(fleet: Sequence[RefitRef]) -> str | None:
    """The refit whose version the fleet converges to: the newest Succeeded one."""
    done = [r for r in fleet if r.phase == "Succeeded"]
    return max(done, key=_order).name if done else None
