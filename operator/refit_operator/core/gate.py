"""The one traffic gate of a pod: whether it may be in traffic (its readiness-gate condition
``refit.rollout.dev/weights-ready`` True), decided from everything it serves. Pure.

A pod carries one gate but a record per track (the base weights, each LoRA adapter), and a pod
group is one unit over several pods. The gate is a function of all of it, never of the pass that
ended last: every writer of the condition (a pass's claim, records and last write, the
reconcile's withdrawal) and every vouch (``POST /refit/ready``) goes through :func:`gate`.

A unit is in traffic only when each of these holds (the first that does not is the reason):

1. it is refitted as a unit (a group with one leader, a pod with its group labels) and every
   pod of it runs and is not being deleted;
2. its base weights' record is of this run (no container restarted, no member replaced since)
   and says they serve: a pass Succeeded, put them back (restored), or stages while they serve;
3. every adapter record says the adapter serves, or that it serves nothing the pod must hold:
   a failed adapter holds the pod out until a pass of its track (a new adapter, a rollback);
   a pass past its in-traffic steps holds it out. An adapter the pod does not hold serves
   nothing and holds nothing out: one probed on another base version than the one served now
   (the base pass unloaded it at its drain; its track needs a refit for the new base), and one
   this process lost, to a restart or to a reload of the same base version (``adapter_missing``:
   its refit loads it again; until then clients asking the pod for it get vLLM's 404).

docs/concepts.md, "One gate over many tracks", has the table ``tests/unit/test_gate.py`` holds.
"""

from __future__ import annotations

from .podflow import Progress, Readiness, base_key, readiness
from .podview import PodView
from .reasons import Reason
from .sequences import ADAPTER_IN_TRAFFIC_STEPS, RESTORE


def gate(unit: PodView, focus: str | None = None) -> Readiness:
    """Whether ``unit`` may be in traffic, with the reason and a message naming the track or
    member that holds it out. ``focus``: the track whose pass just ended, whose own words the
    condition carries when the unit is in traffic (default: the base weights')."""
    out = _held_out(unit)
    if out is not None:
        return out
    records = unit.records
    track = focus if focus is not None and focus in records else ""
    own = readiness(records[track])
    if own is not None and own.ready:
        return own
    # In traffic while the track's pass stages (or restored nothing of its own).
    base = records[""]
    return Readiness(True, Reason.ProbePassed, f"weights {served(base)} probed")


def pass_readiness(unit: PodView, progress: Progress) -> Readiness | None:
    """The condition a pass writes with its record ``progress``: the gate over the unit with
    that record as its track's. None while the pass runs and the unit may stay in traffic
    (staging beside what serves): the condition stays as it is, and only a pass's last write
    ever puts a unit back."""
    g = gate(unit.with_record(progress), focus=progress.track)
    if g.ready and not progress.finished_pass:
        return None
    return g


def base_moved_on(unit: PodView, record: Progress | None) -> bool:
    """Whether the pod's base weights serve another version than the one the adapter record
    ``record`` was probed on: a base pass unloaded that adapter, and its refit no longer
    answers for the pod (the track needs a refit for the new base)."""
    base = unit.records.get("")
    if record is None or not record.adapter or not record.base_version or base is None:
        return False
    version = served(base)
    return bool(version) and version != record.base_version


def adapter_missing(unit: PodView, record: Progress | None) -> bool:
    """Whether the adapter a Succeeded (or restored) record says the pod serves on its base is
    not loaded in this process: lost to a restart, or unloaded by a base pass that reloaded
    the same version. Not served, it holds nothing out; its refit, whose probe reference
    still holds for this base, loads it again (decision: the pod is to do)."""
    if record is None or not record.adapter or not record.finished_pass:
        return False
    if record.outcome != "Succeeded" and not (record.restored and record.serving):
        return False
    base = unit.records.get("")
    if base is None:
        return not unit.same_run(record)
    return _lost(unit, record, base, served(base))


def _lost(unit: PodView, r: Progress, base: Progress, version: str) -> bool:
    """A finished adapter record whose adapter this process no longer holds on the same base
    version: the container restarted, or a pass of the base weights took the pod out of
    traffic since it (and so unloads it at its drain, or did; one that never left traffic left
    it as it was). A base pass still out of traffic serves no version yet: it counts."""
    if version and r.base_version and r.base_version != version:
        return False  # on another base: not served at all (base_moved_on), not missing
    reloaded = bool(r.base_pass) and r.base_pass != base_key(base) and bool(base.left_traffic)
    return not unit.same_run(r) or reloaded


def loaded(base: Progress) -> str:
    """The base version a base record says the model holds, served or not ("" if unknown):
    what an adapter pass on the pod is probed on."""
    return served(base) or (base.version if base.finished_pass else "")


def served(base: Progress) -> str:
    """The base version a base record says the pod serves ("" for none)."""
    if base.outcome == "Succeeded":
        return base.version
    if base.restored or base.in_traffic:
        return base.serving
    return ""


def _held_out(unit: PodView) -> Readiness | None:
    if unit.group_problem is not None:
        p = unit.group_problem
        return Readiness(False, p.reason, p.message)
    if not unit.running or unit.deleting:
        what = f"a pod of group {unit.name}" if unit.members else "the pod"
        state = "is being deleted" if unit.deleting else "is not running"
        return Readiness(False, Reason.MemberNotRunning, f"{what} {state}")
    records = unit.records
    base = records.get("")
    if base is None:
        return Readiness(False, Reason.NotProbed, "no pass has probed the pod's base weights")
    problem = _run_changed(unit, base, "base weights")
    if problem is not None:
        return problem
    own = readiness(base)
    if own is not None and not own.ready:
        return own
    for name in sorted(k for k in records if k):
        problem = _adapter(unit, name, records[name])
        if problem is not None:
            return problem
    return None


def _run_changed(unit: PodView, p: Progress, what: str) -> Readiness | None:
    """A record of another run: a container restarted, or a member replaced, since."""
    if unit.same_run(p):
        return None
    if p.restarts == unit.restarts and p.incarnation != unit.incarnation:
        return Readiness(
            False,
            Reason.MemberReplaced,
            f"a pod of group {unit.name} was replaced or is missing since the pass that loaded "
            f"its {what} ({p.refit}): out of traffic until a pass brings the group back",
        )
    return Readiness(
        False,
        Reason.ContainerRestarted,
        f"the container restarted and lost the {what} its pass loaded ({p.refit}); out of "
        "traffic until a pass brings it back",
    )


def _adapter(unit: PodView, name: str, r: Progress) -> Readiness | None:
    """Why adapter ``name``'s record ``r`` holds the pod out (None: it does not): a failed
    pass in this run, or one past its in-traffic steps."""
    if r.finished_pass and r.outcome != "Succeeded" and not r.restored:
        if not unit.same_run(r):
            return None  # the process that loaded it is gone (and a base pass ran since)
        return Readiness(
            False,
            r.reason or Reason.RefitFailed,
            f"adapter {name} {r.version} failed ({r.reason}: {r.message}); out of traffic "
            "until a refit of the adapter or its rollback",
        )
    if not r.finished_pass:
        if r.step in (*ADAPTER_IN_TRAFFIC_STEPS, RESTORE) and not r.left_traffic:
            return None  # staged beside what serves: nothing served changed yet
        return Readiness(
            False, Reason.Refitting, f"adapter {name} refit to {r.version} in progress"
        )
    # Served, or not served at all, holds nothing out: a refused first adapter, one unloaded
    # when the base moved on (its track needs a refit for the new base), one this process lost
    # (its refit loads it again; until then clients asking for it get vLLM's 404).
    return None
