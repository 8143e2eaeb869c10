"""Fleet-level decisions, pure: which pods go next, whether the gate holds, which refit of a
fleet is active, and which refit is the fleet's current target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .api import TERMINAL_PHASES, ProbeSpec, Strategy, max_unavailable_count

# Where a pod stands within one refit pass.
PodState = Literal["todo", "active", "passed", "failed", "inconclusive", "dropped"]


def next_pods(states: dict[str, PodState], strategy: Strategy) -> list[str]:
    """Pods to start now. Canaries (the first ``canary`` pods by name) go first and must all
    pass before any other pod starts. AllAtOnce then starts every pod; Rolling keeps at most
    maxUnavailable pods in flight (pods that ended failed do not count: with a failureLimit
    above 0 they would otherwise stall the rollout for good)."""
    names = sorted(states)
    canaries = names[: min(strategy.canary, len(names))]
    if any(states[n] != "passed" for n in canaries):
        pool = [n for n in canaries if states[n] == "todo"]
        in_flight = sum(states[n] == "active" for n in canaries)
        if any(states[n] in ("failed", "inconclusive") for n in canaries):
            return []
    else:
        pool = [n for n in names if states[n] == "todo"]
        in_flight = sum(s == "active" for s in states.values())
    if strategy.type == "AllAtOnce":
        return pool
    budget = max_unavailable_count(strategy.max_unavailable, len(names)) - in_flight
    return pool[: max(budget, 0)]


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
            "FailureLimitExceeded",
            f"{failed} pods failed (failureLimit {probe.failure_limit})",
        )
    if inconclusive > probe.inconclusive_limit:
        return Gate(
            True,
            "InconclusiveLimitExceeded",
            f"{inconclusive} pods inconclusive (inconclusiveLimit {probe.inconclusive_limit})",
        )
    return Gate(False)


def all_settled(states: dict[str, PodState]) -> bool:
    return all(s not in ("todo", "active") for s in states.values())


@dataclass(frozen=True)
class RefitRef:
    """What queueing needs to know about one WeightRefit of a fleet."""

    name: str
    created: str  # RFC3339 creationTimestamp (sorts in time order)
    phase: str
    queue_policy: str = "Queue"


@dataclass(frozen=True)
class QueueDecision:
    role: Literal["active", "queued", "superseded", "done"]
    position: int = 0
    superseded_by: str = ""


def _order(r: RefitRef) -> tuple[str, str]:
    return (r.created, r.name)


def queue_role(me: RefitRef, fleet: Sequence[RefitRef]) -> QueueDecision:
    """One active refit per fleet: the oldest one not finished. Later ones wait in creation
    order. A refit not yet started is superseded by any later refit with queuePolicy
    LatestWins (a refit in progress is never abandoned: it finishes or fails)."""
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
    live = [r for r in pending if winner(r) is None]
    # A refit already past Queued keeps its turn even if an older one shows up late.
    active = next((r for r in live if started(r)), live[0])
    if active.name == me.name:
        return QueueDecision("active")
    waiting = [r for r in live if r.name != active.name]
    return QueueDecision("queued", position=1 + [r.name for r in waiting].index(me.name))


def fleet_target(fleet: Sequence[RefitRef]) -> str | None:
    """The refit whose version the fleet converges to: the newest Succeeded one."""
    done = [r for r in fleet if r.phase == "Succeeded"]
    return max(done, key=_order).name if done else None
