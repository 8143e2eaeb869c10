"""Garbage collection of finished WeightRefits: which ones to delete, by policy. Pure.

A training run creates one WeightRefit per step, for thousands of steps. Without a policy
every one of them stays in etcd, in `kubectl get wr` and in the operator's index forever.
The policy (docs/concepts.md, "History and garbage collection"):

- Only finished refits (api_status.TERMINAL_PHASES) are ever deleted; an active or queued one never.
- A fleet is what the queue calls one: refits that select a pod in common (``Finished.pods``)
  are one fleet, chained (a and b share a pod, b and c another: one fleet), whatever their
  selectors' text; refits with the same selector text are one fleet too (a fleet scaled to
  zero selects no pod and still has a target for the pods that come back).
- Per fleet, at most `Policy.history_limit` finished refits are kept: the newest in creation
  order (times.order_key). The refits kept whatever the limit says count as some of them.
- A finished refit with `spec.ttlSecondsAfterFinished` is deleted once that many seconds have
  passed since its `status.completionTime` (a refit whose completion time is unknown is
  never deleted by its TTL, only by the count).
- Each pod's **target** — the newest Succeeded refit that selects it, by the same order as
  plan.fleet_target — is never deleted, whatever the limit or its TTL: it is the rollback
  target of the next refit (status.previous) and the refit that keeps converging the pod when
  it restarts (and, for a selector, pods that join later). A history_limit of 0 therefore
  keeps exactly the targets (or nothing when no pod ever had a Succeeded refit).
- When a pod's target is a broadcast (nothing to load its version from again), the newest
  refit that selects the pod and loaded a checkpoint the pod's fleet served (Succeeded, or
  Superseded because its pods moved on) is kept as well: it is the rollback target.
- A selector that selects no pod now keeps the target (and rollback target) of the refits
  with that selector text, as above.

The engine feeds `to_delete` from its in-memory index and one list of the namespace's pods; it
costs O(n log n + n p) for n refits that exist now (which the policy itself keeps bounded) and
p pods.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import times
from .api_status import TERMINAL_PHASES, Phase

DEFAULT_HISTORY_LIMIT = 10


@dataclass(frozen=True)
class Finished:
    """One WeightRefit as the garbage collector sees it (active ones included: never deleted).

    name is returned as given: when refits of several namespaces go into one call, pass a
    name that is unique across them (e.g. "namespace/name").
    """

    name: str
    created: str  # creation order (times.creation_order: sorts in creation order)
    phase: Phase  # status.phase
    completed: float | None  # status.completionTime as Unix seconds; None if unknown
    ttl: int | None  # spec.ttlSecondsAfterFinished; None: no TTL
    fleet: str  # selector text: refits with equal texts are one fleet
    # Its weights can be loaded again (a checkpoint or adapter directory; not a broadcast's
    # tensors): a rollback target.
    checkpoint: bool = True
    moved_on: bool = False  # Superseded because its pods moved on (the fleet served it)
    pods: frozenset[str] = frozenset()  # the pods its selector selects now
    # The weights it refits (WeightRefitSpec.track): refits of other weights on the same pods
    # are another fleet, with a target and rollback target of their own.
    track: str = ""

    @classmethod
    def from_object(cls, obj: Mapping[str, Any], fleet: str) -> Finished:
        """From a WeightRefit as the API server returns it (a dict)."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        ttl = spec.get("ttlSecondsAfterFinished")
        return cls(
            name=str(meta.get("name", "")),
            created=times.order_of(meta),
            phase=status.get("phase") or "Pending",
            completed=times.epoch(status.get("completionTime")),
            ttl=ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else None,
            fleet=fleet,
            checkpoint="broadcast" not in spec,  # a broadcast's tensors cannot be loaded again
            track=str((spec.get("adapter") or {}).get("name", "")),
        )


@dataclass(frozen=True)
class Policy:
    """How many finished refits each fleet keeps (the TTL is per refit, in its spec)."""

    # Finished refits kept per fleet, newest by creation, the fleet's target included.
    # 0 keeps only the target.
    history_limit: int = DEFAULT_HISTORY_LIMIT

    def __post_init__(self) -> None:
        limit = self.history_limit
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise ValueError(f"history_limit must be an integer, got {limit!r}")
        if limit < 0:
            raise ValueError(
                f"history_limit must be >= 0 (finished refits kept per fleet; 0 keeps only "
                f"the fleet's newest Succeeded refit), got {limit}"
            )


def _order(r: Finished) -> tuple[str, str]:
    return times.order_key(r.created, r.name)


def target(fleet: Sequence[Finished]) -> Finished | None:
    """The fleet's newest Succeeded refit: kept whatever the policy says."""
    done = [r for r in fleet if r.phase == "Succeeded"]
    return max(done, key=_order) if done else None


def rollback_target(fleet: Sequence[Finished]) -> Finished | None:
    """The fleet's newest refit that loaded a checkpoint the fleet served (Succeeded, or
    Superseded by a newer refit, such as a broadcast, that took every pod over): kept too."""
    served = [r for r in fleet if r.checkpoint and (r.phase == "Succeeded" or r.moved_on)]
    return max(served, key=_order) if served else None


def fleets(refits: Sequence[Finished]) -> list[list[Finished]]:
    """The refits grouped as the queue groups them: by the pods they share (chained), and by
    equal selector text; refits of other weights (``track``) are other fleets."""
    parent = list(range(len(refits)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, r in enumerate(refits):
        for key in (f"fleet {r.track} {r.fleet}", *(f"pod {r.track} {p}" for p in r.pods)):
            j = first.setdefault(key, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[Finished]] = defaultdict(list)
    for i, r in enumerate(refits):
        groups[root(i)].append(r)
    return list(groups.values())


def kept(refits: Sequence[Finished]) -> set[str]:
    """Names of the refits kept whatever the policy says: each pod's target and rollback
    target, and those of each selector text that selects no pod now."""
    # Pods that the same refits select have the same target: decide once per such set.
    chosen_by: dict[tuple[str, str], list[Finished]] = defaultdict(list)
    by_text: dict[tuple[str, str], list[Finished]] = defaultdict(list)
    for r in refits:
        for p in r.pods:
            chosen_by[r.track, p].append(r)
        if not r.pods:
            by_text[r.track, r.fleet].append(r)
    unique = {tuple(r.name for r in rs): rs for rs in chosen_by.values()}
    keep = set()
    for members in (*unique.values(), *by_text.values()):
        keep |= {r.name for r in (target(members), rollback_target(members)) if r is not None}
    return keep


def to_delete(refits: Sequence[Finished], policy: Policy, now: float) -> list[str]:
    """Names of the refits to delete now, oldest first (in creation order).

    refits: every WeightRefit the operator knows, of any phase and fleet; now: Unix seconds.
    """
    kept_all = kept(refits)
    doomed: list[Finished] = []
    for members in fleets(refits):
        keep = {r.name for r in members if r.name in kept_all}
        finished = sorted(
            (r for r in members if r.phase in TERMINAL_PHASES), key=_order, reverse=True
        )
        others = [r for r in finished if r.name not in keep]
        # The kept ones take places of the limit; with a limit of 0 they are still kept.
        room = policy.history_limit - len(keep)
        for i, r in enumerate(others):
            over_limit = i >= room
            if over_limit or _expired(r, now):
                doomed.append(r)
    return [r.name for r in sorted(doomed, key=_order)]


def _expired(r: Finished, now: float) -> bool:
    if r.ttl is None or r.completed is None:
        return False
    return now >= r.completed + max(r.ttl, 0)
