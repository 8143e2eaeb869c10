"""What the operator knows of every WeightRefit it watches, without reading them: enough to
queue refits that share pods, find a rollback target, wake the refits a finish concerns and
collect history. Fed by the watch (handlers.refit_event) and the start-up list; pure: the
engine does the I/O around it. Bounded by the refits that exist, which history keeps few."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import history, plan, times
from .api_spec import WeightRefitSpec
from .api_status import TERMINAL_PHASES, Phase, Previous
from .podview import PodView
from .reasons import Reason
from .sequences import FLOWS


@dataclass(frozen=True)
class Known:
    namespace: str
    name: str
    uid: str
    created: str  # creation order (times.creation_order), the stamp included
    phase: Phase
    spec: WeightRefitSpec
    completed: float | None
    deleting: bool = False  # deletion requested: collected already, its finalizer runs
    # Superseded because every pod moved on to a newer refit that Succeeded: the fleet served
    # this one's version, probed (unlike a refit LatestWins superseded before it ran).
    moved_on: bool = False
    stamp: str = ""  # the creation stamp (times.CREATED_ANNOTATION); "" while it has none
    stamped: bool = True  # the object carries ``stamp``: False while the operator's is unwritten
    # The object's resourceVersion as a number (0: none): the operator folds its own status
    # writes in at once, so a watch event that shows an older state is not taken over them.
    version: int = 0

    @property
    def served(self) -> bool:
        """The fleet served this refit's version: a candidate rollback target."""
        return self.phase == "Succeeded" or self.moved_on

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Known | None:
        meta, status = doc["metadata"], doc.get("status") or {}
        try:
            spec = WeightRefitSpec.model_validate(doc.get("spec") or {})
        except ValueError:
            return None  # the CRD's schema keeps these out; nothing to queue against
        stamp = times.stamp_of(meta)
        return cls(
            meta.get("namespace", ""), meta["name"], meta["uid"], times.order_of(meta),
            status.get("phase", "Pending"), spec, times.epoch(status.get("completionTime")),
            bool(meta.get("deletionTimestamp")),
            status.get("phase") == "Superseded" and _ready_reason(status) == Reason.PodsMovedOn,
            stamp, bool(stamp), _version(meta),
        )  # fmt: skip

    def ref(self, phase: Phase | None = None) -> plan.RefitRef:
        return plan.RefitRef(
            self.name, self.created, phase or self.phase, self.spec.queue_policy,
            self.spec.fleet.selector,
        )  # fmt: skip


def _version(meta: dict[str, Any]) -> int:
    rv = str(meta.get("resourceVersion", ""))
    return int(rv) if rv.isdigit() else 0


def _ready_reason(status: dict[str, Any]) -> str:
    conditions: list[dict[str, Any]] = status.get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), {})
    return str(ready.get("reason", ""))


class RefitIndex:
    def __init__(self) -> None:
        self.known: dict[str, Known] = {}  # by uid
        # uid -> ``seq`` when the refit was first folded in: a read of the API server that
        # began after it and does not show the refit proves it gone (a missed DELETED event).
        self.first_seen: dict[str, int] = {}
        self.seq = 0  # counts the refits folded in

    def observe(self, doc: dict[str, Any], deleted: bool = False, stamp: str = "") -> Known | None:
        """Fold a watched (or just read) WeightRefit in; a deleted one is dropped and
        returned, so the caller forgets what it kept for it.

        A refit seen without a creation stamp gets ``stamp`` (the operator's clock, at first
        sight: watch order), kept from then on until the object carries it (``stamped``): its
        place in the order never changes once a decision used it."""
        uid = doc["metadata"]["uid"]
        known = None if deleted else Known.from_doc(doc)
        if known is None:
            self.first_seen.pop(uid, None)
            return self.known.pop(uid, None)
        before = self.known.get(uid)
        if before is not None and before.version > known.version:
            return None  # an event from before the write this operator folded in already
        if uid not in self.first_seen:
            self.seq += 1
            self.first_seen[uid] = self.seq
        if not known.stamped:
            given = before.stamp if before is not None and before.stamp else stamp
            if given:
                created = times.creation_order(doc["metadata"]["creationTimestamp"], given)
                known = replace(known, created=created, stamp=given)
        self.known[uid] = known
        return None

    def drop_missing(
        self, namespace: str, present: set[str], since: int, name: str | None = None
    ) -> list[Known]:
        """Drop the refits of ``namespace`` (named ``name``, when given) that a read of the
        API server begun when ``seq`` was ``since`` did not return (``present``: the uids it
        returned) and that were known before it began: deleted, with the DELETED event lost
        to a watch that relisted. A refit first seen after the read began may be newer than
        what it returned: it stays. Returns the dropped ones, so the caller forgets them."""
        gone = [
            k for k in self.known.values()
            if k.namespace == namespace and (name is None or k.name == name)
            and k.uid not in present and self.first_seen.get(k.uid, since + 1) <= since
        ]  # fmt: skip
        for k in gone:
            del self.known[k.uid]
            self.first_seen.pop(k.uid, None)
        return gone

    def order(self, uid: str, meta: dict[str, Any]) -> str:
        """The creation order of refit ``uid``: the index's (with the stamp it was given at
        first sight), else the one its metadata says."""
        k = self.known.get(uid)
        return k.created if k is not None else times.order_of(meta)

    def unstamped(self, uid: str) -> Known | None:
        """Refit ``uid`` when the operator's creation stamp is still to be written on it."""
        k = self.known.get(uid)
        return k if k is not None and not k.stamped and k.stamp else None

    def stamped(self, uid: str, stamp: str) -> None:
        """The object carries ``stamp`` now."""
        k = self.known.get(uid)
        if k is not None and k.stamp == stamp:
            self.known[uid] = replace(k, stamped=True)

    def names(self, namespace: str) -> dict[str, str]:
        """uid -> name of every refit of the namespace (a claim of a refit not here is stale)."""
        return {k.uid: k.name for k in self.known.values() if k.namespace == namespace}

    def sharing(
        self,
        namespace: str,
        uid: str,
        created: str,
        phase: Phase,
        pods: Sequence[PodView],
        track: str | None = None,
        name: str = "",
    ) -> tuple[list[plan.RefitRef], Previous | None]:
        """The refits that select at least one of ``pods`` (the refit ``uid``'s own, itself
        included with its current ``phase``), and the newest Succeeded one of them created
        before it: the rollback target. Fleets are compared by the pods they select, so two
        selectors written differently that pick the same pods are one fleet. ``track`` and
        ``name``: the refit's own (its spec's), which the caller has even once the index
        dropped the refit (being deleted); else the index's."""
        refs, succeeded = [], []
        me = self.known.get(uid)
        mine = times.order_key(created, me.name if me is not None else name)
        if track is None:
            track = me.spec.track if me is not None else ""
        for k in self.known.values():
            # A refit of other weights (a LoRA adapter's, or the base model's) is of another
            # fleet: its own queue, target and rollback target (WeightRefitSpec.track).
            if k.namespace != namespace or k.spec.track != track:
                continue
            if k.uid != uid and not any(k.spec.fleet.selector.matches(p.labels) for p in pods):
                continue
            ref = k.ref(phase if k.uid == uid else None)
            refs.append(ref)
            # A broadcast leaves nothing to load its version from again: the rollback target
            # is the last checkpoint (or adapter) the fleet served.
            if (
                (ref.phase == "Succeeded" or (k.uid != uid and k.moved_on))
                and k.uid != uid
                and times.order_key(k.created, k.name) < mine
                and k.spec.path
            ):
                succeeded.append(k)
        previous = None
        if succeeded:
            last = max(succeeded, key=lambda k: times.order_key(k.created, k.name))
            previous = Previous(version=last.spec.version, path=last.spec.path, refit=last.name)
        return refs, previous

    def to_wake(self, namespace: str, fleet: Sequence[plan.RefitRef], uid: str) -> list[str]:
        """uids of the refits a finish of refit ``uid`` concerns: those of ``fleet`` that are
        queued or active (one may start now), and of those the fleet served (Succeeded, or
        Superseded because their pods moved on) the newest per selector: the fleet's previous
        target, whose pods may have moved on, or which is the target again. An older one in
        history was already moved on from by that one, so others' progress never wakes it
        (each wake is a read of the refit and its pods); its dormant tick still comes."""
        names = {r.name for r in fleet}
        mine = [k for k in self.known.values()
                if k.namespace == namespace and k.name in names and k.uid != uid]  # fmt: skip
        newest: dict[str, Known] = {}
        for k in mine:
            if k.phase in TERMINAL_PHASES and k.served:
                sel = k.spec.fleet.selector.canonical()
                have = newest.get(sel)
                if have is None or times.order_key(k.created, k.name) > times.order_key(
                    have.created, have.name
                ):
                    newest[sel] = k
        served = {k.uid for k in newest.values()}
        return [k.uid for k in mine if k.phase not in TERMINAL_PHASES or k.uid in served]

    def to_wake_on_delete(self, gone: Known) -> list[str]:
        """uids of the refits a deletion of ``gone`` may concern: every refit of its namespace
        that to_wake would wake (which of them shared pods with it is no longer known: the
        pods its selector matched are not at hand). A deleted refit's pods may have a new
        target, which must take up a pod that restarts at once."""
        fleet = [k.ref() for k in self.known.values() if k.namespace == gone.namespace]
        return self.to_wake(gone.namespace, fleet, gone.uid)

    def to_collect(
        self, namespace: str, policy: history.Policy, now: float, pods: Sequence[PodView] = ()
    ) -> list[Known]:
        """Refits of the namespace the history policy no longer keeps and whose deletion was
        not asked yet; they are marked as being deleted. ``pods``: the namespace's pods, by
        which refits are grouped into fleets as the queue groups them (history.fleets)."""
        mine = {k.name: k for k in self.known.values() if k.namespace == namespace}
        finished = [
            history.Finished(k.name, k.created, k.phase, k.completed,
                             k.spec.ttl_seconds_after_finished, k.spec.fleet.selector.canonical(),
                             FLOWS[k.spec.source].loads_again, k.moved_on,
                             frozenset(p.name for p in pods
                                       if k.spec.fleet.selector.matches(p.labels)),
                             k.spec.track)
            for k in mine.values()
        ]  # fmt: skip
        out = []
        for name in history.to_delete(finished, policy, now):
            k = mine[name]
            if not k.deleting:
                self.known[k.uid] = replace(k, deleting=True)
                out.append(k)
        return out
