"""The safety invariants as code, over the explorer's ground truth: the in-memory API server's
objects (what the operator wrote) and the simulated pod processes (what the pods really hold).
Each check names the invariant it holds (the table in docs/concepts.md, "Invariants and the
explorer").

- one-driver: a pod admits a fenced call only from the pass whose claim the pod records now
  (no two passes' calls interleave on one pod);
- ready-probed: a pod that is Ready (its weights-ready condition True and its container
  ready, i.e. vouched for in this process) holds intact weights of the version it reports,
  and a correct probe was scored on exactly those weights in this process; and every
  adapter it serves under a client's name was loaded right and probed through that name;
- succeeded-serving: when a refit turns Succeeded, every pod it counts serves its version
  (an adapter refit's: the adapter's version under its name);
- finished-says-served: when a refit turns RolledBack, every pod its message says it rolled
  back to a version serves that version (and every pod it kept serves what it served), and
  the message names every pod its rollback brought back; when it turns Superseded because its
  pods moved on (PodsMovedOn), every pod it selects is driven by a newer refit, the newest
  of which the message names;
- failed-out: a pod whose record of any track (the base weights, or an adapter) is failed
  in the run that runs now (Failed or Inconclusive, not restored) is never Ready (its
  weights-ready condition True): no pass of another track vouches for it (an adapter's
  pass refused before its swap changed nothing the pod serves: it holds nothing out);
- adapter-held: a pod that no pass holds (no claim) holds no LoRA adapter that no record on
  it names: no staged name (``name@version``), no name of a track it has no record of;
- group-withdrawn: no member of a pod group is Ready while the group is out by its records
  and members (a member missing, not running, or in another run than the leader's base
  record names): within one tick, every completed tick of a refit that selects the group
  (a tick that began after the group turned so) leaves none Ready;
- gate-held: a pod whose weights-ready condition is True belongs to a unit (the pod, or its
  group) that the one traffic gate (core/gate.py, over every track's record and every member)
  lets in, with the same grace of one tick: a completed tick of a refit that selects the
  unit, begun after the gate turned False, leaves no member Ready unless a pass holds it;
- lease-stop: an operator process sends nothing (API write, pod call) once its lease may
  have expired (explore.py checks it as each request leaves);
- liveness: once faults stop, every pod reaches its target (the newest Succeeded refit, by
  creation order, that selects it now) and is Ready, and no refit stays active;
- bounded-memory: an engine keeps nothing (index, per-refit state) of refits that are gone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from refit_operator.controller.reconcile_loop import Engine
from refit_operator.core import groups, times
from refit_operator.core.api_spec import (
    LEADER_INDEX,
    LWS_GROUP_LABEL,
    LWS_INDEX_LABEL,
    Groups,
    LabelSelector,
)
from refit_operator.core.claim import CLAIM_ANNOTATION, Claim
from refit_operator.core.gate import base_moved_on, gate
from refit_operator.core.podflow import (
    ADAPTER_PROGRESS_PREFIX,
    PROGRESS_ANNOTATION,
    Progress,
    progress_annotation,
)
from refit_operator.core.podview import PodView
from refit_operator.core.reasons import Reason
from refit_operator.core.sequences import ADAPTER_IN_TRAFFIC_STEPS, FLOWS, RESTORE
from refit_worker.contract import READINESS_GATE

from .memcluster import Store
from .workers import ExplorerSimServer

ACTIVE = frozenset({"", "Pending", "Queued", "Preflight", "Progressing", "RollingBack"})


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    at: float  # virtual seconds into the schedule

    def __str__(self) -> str:
        return f"[{self.invariant}] at {self.at:.3f}s: {self.message}"


def _gate(doc: dict[str, Any]) -> bool:
    conds = (doc.get("status") or {}).get("conditions") or []
    return any(c.get("type") == READINESS_GATE and c.get("status") == "True" for c in conds)


def _identity(doc: dict[str, Any] | None) -> Any:
    """What of a pod a list taken earlier could not show: that it exists (which one), its
    labels, its process (restarts, IP)."""
    if doc is None:
        return None
    status = doc.get("status") or {}
    restarts = [c.get("restartCount", 0) for c in status.get("containerStatuses") or []]
    meta = doc["metadata"]
    return (meta.get("uid"), meta.get("labels"), restarts, status.get("podIP"))


def _reason(doc: dict[str, Any], message: bool = False) -> str:
    """The reason of a pod's weights-ready condition (with its message)."""
    conds = (doc.get("status") or {}).get("conditions") or []
    for c in conds:
        if c.get("type") == READINESS_GATE:
            reason = str(c.get("reason", ""))
            return f"{reason} {c.get('message', '')!r}" if message else reason
    return ""


def _ready_reason(refit: dict[str, Any]) -> str:
    conds = (refit.get("status") or {}).get("conditions") or []
    return next((str(c.get("reason", "")) for c in conds if c.get("type") == "Ready"), "")


def _selects(refit: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = LabelSelector.model_validate(refit["spec"]["fleet"]["selector"])
    return sel.matches(labels)


def _track(refit: dict[str, Any]) -> str:
    """The weights a refit refits (WeightRefitSpec.track): "" for the base weights, else the
    adapter's name."""
    adapter = refit["spec"].get("adapter")
    return str(adapter["name"]) if adapter else ""


def _version(refit: dict[str, Any]) -> str:
    spec = refit["spec"]
    return str((spec.get("adapter") or spec.get("checkpoint") or spec.get("broadcast"))["version"])


def _record(doc: dict[str, Any], track: str = "") -> Progress | None:
    """The pod's record of ``track``."""
    notes = doc["metadata"].get("annotations") or {}
    return Progress.from_annotation(notes.get(progress_annotation(track)))


def _records(doc: dict[str, Any]) -> dict[str, Progress]:
    """Every track's record on the pod: "" for the base weights, else the adapter's name."""
    out = {}
    for key, text in (doc["metadata"].get("annotations") or {}).items():
        if key == PROGRESS_ANNOTATION or key.startswith(ADAPTER_PROGRESS_PREFIX):
            p = Progress.from_annotation(text)
            if p is not None:
                out[key.removeprefix(ADAPTER_PROGRESS_PREFIX) if key != PROGRESS_ANNOTATION
                    else ""] = p  # fmt: skip
    return out


def _follower(doc: dict[str, Any]) -> bool:
    """A pod group's member that is not its leader (its records are the leader's)."""
    index = (doc["metadata"].get("labels") or {}).get(LWS_INDEX_LABEL)
    return index is not None and index != LEADER_INDEX


def _said(records: dict[str, Progress]) -> str:
    """Records for a message: ``track: refit's pass at version outcome (reason)``."""
    return (
        "; ".join(
            f"{t or 'base'}: {p.refit}'s {'rollback ' if p.rollback else ''}pass at {p.version} "
            f"{p.outcome or 'in flight'}{f' ({p.reason})' if p.reason else ''}"
            for t, p in sorted(records.items())
        )
        or "none"
    )


def _restarts(doc: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in doc["status"].get("containerStatuses") or [])


def _in_traffic_unclaimed(members: list[dict[str, Any]]) -> bool:
    """Some pod of a unit is Ready and no pass holds the unit (a pass's own writes take it
    out or put it back)."""
    claimed = any(CLAIM_ANNOTATION in (m["metadata"].get("annotations") or {}) for m in members)
    return not claimed and any(_gate(m) for m in members)


def _failed(p: Progress) -> bool:
    return p.outcome in ("Failed", "Inconclusive") and not p.restored


def _refused_in_traffic(p: Progress) -> bool:
    """An adapter's pass that ended before its swap: it changed nothing the pod serves (the
    staged name was unloaded), whatever its record says of the pod's traffic; or a weights
    pass refused while it staged, before the pod left traffic (a checkpoint without the
    drafter/ its pods need: DrafterMissing), which touched nothing either. ready-probed still
    holds such a pod to what it serves."""
    if p.source == "adapter":
        return p.step in (*ADAPTER_IN_TRAFFIC_STEPS, RESTORE)
    return p.step in FLOWS[p.source].serving_steps and not p.left_traffic


class Checker:
    def __init__(
        self,
        store: Store,
        sim: ExplorerSimServer,
        note: Callable[[str], None],
        grouped: bool = False,
        ignore: frozenset[str] = frozenset(),
    ) -> None:
        self.store, self.sim, self.note = store, sim, note
        self.grouped = grouped
        self.ignore = ignore  # invariants not held (Config.ignore)
        self.ignored: set[str] = set()
        self.violations: list[Violation] = []
        self.checks = 0
        # Pod groups: group key -> the store revision at which the group last turned out of
        # traffic by its members and records (absent while it is not).
        self.out_since: dict[str, int] = {}
        # Units (a pod, or a group by its leader's name) -> the store revision since which
        # it is in traffic against the gate with no pass holding it.
        self.gate_out_since: dict[str, int] = {}
        # pod name -> the store revision at which it last changed in a way a list taken before
        # cannot show (created, deleted, relabelled, restarted, moved to a new IP)
        self.changed: dict[str, int] = {}

    def violate(self, invariant: str, message: str) -> None:
        v = Violation(invariant, message, self.sim_time())
        if invariant in self.ignore:  # to look past a known hole: traced once, not counted
            if message not in self.ignored:
                self.ignored.add(message)
                self.note(f"ignored {v}")
            return
        self.note(f"VIOLATION {v}")
        self.violations.append(v)

    def sim_time(self) -> float:
        import asyncio

        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return 0.0

    def _pod_at(self, ip: str) -> dict[str, Any] | None:
        for (kind, _, _), doc in self.store.objects.items():
            if kind == "Pod" and doc["status"].get("podIP") == ip:
                return doc
        return None

    # ------------------------------------------------------------------ one driver
    def on_call(self, ip: str, step: str, token: int) -> None:
        """A pod admitted a fenced call: it must come from the pass that holds the claim."""
        self.checks += 1
        self.note(f"worker {ip} admits {step} fence={token}")
        doc = self._pod_at(ip)
        if doc is None:
            return  # a process whose pod object is gone: nobody is Ready through it
        claim = Claim.from_annotation(
            (doc["metadata"].get("annotations") or {}).get(CLAIM_ANNOTATION)
        )
        if claim is None or claim.fence != token:
            held = f"{claim.refit} fence {claim.fence} ({claim.holder})" if claim else "nobody"
            self.violate(
                "one-driver",
                f"pod {doc['metadata']['name']} admitted {step} with fence {token} while its "
                f"claim is held by {held}",
            )

    # ----------------------------------------------------------- state invariants
    def check_state(self) -> None:
        units = self._units()
        for (kind, _, name), doc in sorted(self.store.objects.items()):
            if kind != "Pod":
                continue
            self._check_adapters_held(name, doc)
            if not _gate(doc):
                continue
            self.checks += 1
            if not self.grouped or name in units:  # a follower's records are its leader's
                self._check_failed_out(name, doc, units.get(name))
            ip = doc["status"].get("podIP", "")
            pod = self.sim.pods.get(ip)
            if pod is None or not pod.up or not pod.ready_mark.ready:
                continue  # not Ready: the container is down or not vouched for
            serves = self.sim.serves(ip)
            if serves is None or not self.sim.probed(ip):
                stale = pod.drafter and pod.draft_rate() < 1
                self.violate(
                    "ready-probed",
                    f"pod {name} is Ready but serves {pod.weight_version!r} "
                    f"(loaded {pod.seed!r}, damaged={pod.weights_discarded}"
                    f"{', beside a stale drafter' if stale else ''}) "
                    f"{'with' if self.sim.probed(ip) else 'without'} a probe of these weights "
                    "in this process",
                )
            for adapter, version in sorted(self.sim.adapters(ip).items()):
                if "@" in adapter:
                    continue  # a staged name: no client sends it
                if version is None or not self.sim.adapter_probed(ip, adapter):
                    self.violate(
                        "ready-probed",
                        f"pod {name} is Ready and serves adapter {adapter!r} "
                        f"{'loaded wrong' if version is None else f'at {version}'}, "
                        f"{'with' if self.sim.adapter_probed(ip, adapter) else 'without'} a "
                        "correct probe through that name since its load",
                    )

    def _check_failed_out(self, name: str, doc: dict[str, Any], unit: PodView | None) -> None:
        """failed-out: a Ready pod has no record failed in the run that runs now."""
        restarts = _restarts(doc)
        for track, p in sorted(_records(doc).items()):
            same = unit.same_run(p) if unit is not None else p.restarts == restarts
            if _failed(p) and same and not _refused_in_traffic(p):
                what = f"adapter {track}" if track else "base weights"
                self.violate(
                    "failed-out",
                    f"pod {name} is Ready (condition {_reason(doc, True)}) while its {what} record "
                    f"is {p.outcome} in this run ({p.refit} at {p.version}: {p.reason})",
                )

    def _check_adapters_held(self, name: str, doc: dict[str, Any]) -> None:
        """adapter-held: once no pass holds the pod, it holds only adapters its records name."""
        notes = doc["metadata"].get("annotations") or {}
        if notes.get(CLAIM_ANNOTATION) or doc["metadata"].get("deletionTimestamp"):
            return
        held = self.sim.adapters(doc["status"].get("podIP", ""))
        if not held:
            return
        self.checks += 1
        records = {t: p for t, p in _records(doc).items() if t}
        for adapter in sorted(set(held) - set(records)):
            self.violate(
                "adapter-held",
                f"pod {name} holds adapter {adapter!r}, which no record on it names "
                f"(records: {_said(records)}; Ready={_gate(doc)}; no pass holds the pod)",
            )

    # ------------------------------------------------------------------ pod groups
    def _units(self) -> dict[str, PodView]:
        """The fleet's refit units by leader name, as the operator folds pod groups
        (groups.units over every pod in the store)."""
        if not self.grouped:
            return {}
        views = [PodView.from_pod(d) for (k, _, _), d in sorted(self.store.objects.items())
                 if k == "Pod"]  # fmt: skip
        return {u.name: u for u in groups.units(views, Groups())}

    def _unit(self, doc: dict[str, Any]) -> PodView:
        """The pod as the operator judges it: the unit it leads (a group's records are of the
        group's run: every member's restarts, the followers it was made with), else itself."""
        return self._units().get(doc["metadata"]["name"]) or PodView.from_pod(doc)

    def _group_members(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for (kind, _, _), doc in sorted(self.store.objects.items()):
            key = (doc["metadata"].get("labels") or {}).get(LWS_GROUP_LABEL)
            if kind == "Pod" and key is not None:
                out.setdefault(key, []).append(doc)
        return out

    def group_out(self, key: str, members: list[dict[str, Any]]) -> str:
        """Why a pod group is out of traffic by its members and its leader's base record
        ("" when it is not): a member not running, or deleting; no single leader; no record;
        a record of another run (a member restarted, replaced or gone since: the record's
        incarnation names the followers it was made with)."""
        for m in members:
            if m["status"].get("phase") != "Running" or m["metadata"].get("deletionTimestamp"):
                return f"member {m['metadata']['name']} is {m['status'].get('phase')}"
        leaders = [m for m in members if not _follower(m)]
        if len(leaders) != 1:
            return f"it has {len(leaders)} leaders"
        views = [PodView.from_pod(m) for m in members]
        (unit,) = groups.units(views, Groups())
        p = unit.progress
        if p is None:
            return "its leader has no record"
        if not unit.same_run(p):
            return (
                f"its leader's record ({p.refit} at {p.version}) is of another run (restarts "
                f"{p.restarts}, now {unit.restarts}; followers "
                f"{'the same' if p.incarnation == unit.incarnation else 'replaced'})"
            )
        return ""

    def on_pod_write(self, doc: dict[str, Any]) -> None:
        """Note the revision at which a group turned half in traffic: some member Ready, no
        pass holding it, while it is out by its members and records (group-withdrawn's
        grace runs from there)."""
        key = (doc["metadata"].get("labels") or {}).get(LWS_GROUP_LABEL)
        if key is None:
            return
        members = self._group_members().get(key, [])
        if _in_traffic_unclaimed(members) and self.group_out(key, members):
            self.out_since.setdefault(key, self.store.revision)
        else:
            self.out_since.pop(key, None)

    # ------------------------------------------------------------------- the gate
    def _unit_members(self) -> dict[str, list[dict[str, Any]]]:
        """Each unit's pods by the unit's name: a pod alone, or a group (its leader's name,
        as groups.units names it)."""
        pods = [d for (k, _, _), d in sorted(self.store.objects.items()) if k == "Pod"]
        if not self.grouped:
            return {d["metadata"]["name"]: [d] for d in pods}
        by_key: dict[str, list[dict[str, Any]]] = {}
        out: dict[str, list[dict[str, Any]]] = {}
        for d in pods:
            key = (d["metadata"].get("labels") or {}).get(LWS_GROUP_LABEL)
            if key is None:
                out[d["metadata"]["name"]] = [d]
            else:
                by_key.setdefault(key, []).append(d)
        for members in by_key.values():
            leaders = [m for m in members if not _follower(m)]
            name = (leaders[0] if len(leaders) == 1 else members[0])["metadata"]["name"]
            out[name] = members
        return out

    def _gate_of(self, members: list[dict[str, Any]]) -> tuple[bool, str]:
        views = [PodView.from_pod(m) for m in members]
        unit = groups.units(views, Groups())[0] if self.grouped else views[0]
        g = gate(unit)
        return g.ready, f"{g.reason}: {g.message}"

    def _track_gate(self) -> None:
        """Note the revision at which each unit turned in traffic against its gate: some
        member Ready, no pass holding it, the gate False (gate-held's grace runs from
        there)."""
        units = self._unit_members()
        for name, members in units.items():
            if not _in_traffic_unclaimed(members) or self._gate_of(members)[0]:
                self.gate_out_since.pop(name, None)
            elif name not in self.gate_out_since:
                self.gate_out_since[name] = self.store.revision
        for name in set(self.gate_out_since) - set(units):
            del self.gate_out_since[name]

    def _due(
        self,
        units: dict[str, list[dict[str, Any]]],
        out_since: dict[str, int],
        refit: dict[str, Any],
        began: int,
    ) -> Iterator[tuple[str, list[dict[str, Any]], int, list[str]]]:
        """The units ``refit`` selects that were out (by ``out_since``) before its tick began
        at revision ``began``, still in traffic and unclaimed: (name, members, since, the
        members Ready). Each is one check."""
        for name, members in sorted(units.items()):
            since = out_since.get(name)
            if since is None or since > began:
                continue
            if not any(_selects(refit, m["metadata"].get("labels") or {}) for m in members):
                continue
            self.checks += 1
            if _in_traffic_unclaimed(members):
                yield name, members, since, [m["metadata"]["name"] for m in members if _gate(m)]

    def after_tick(self, refit: dict[str, Any] | None, began: int) -> None:
        """gate-held and group-withdrawn: a completed tick of ``refit`` that began at store
        revision ``began`` leaves no member Ready of a unit it selects that was in traffic
        against its gate (a group: out by its members and records) by then, unless a pass
        holds the unit (its first write takes it out)."""
        if refit is None or refit["metadata"].get("deletionTimestamp"):
            return
        tick = (
            f"a tick of refit {refit['metadata']['name']} that began at revision {began} left "
            "it in traffic"
        )
        for name, members, since, ready in self._due(
            self._unit_members(), self.gate_out_since, refit, began
        ):
            held, why = self._gate_of(members)
            if not held:
                self.violate(
                    "gate-held",
                    f"unit {name}: {', '.join(ready)} Ready while the gate holds it out "
                    f"({why}) since revision {since}; {tick}",
                )
        for key, members, since, ready in self._due(
            self._group_members(), self.out_since, refit, began
        ):
            why = self.group_out(key, members)
            if why:
                self.violate(
                    "group-withdrawn",
                    f"group {key}: {', '.join(ready)} Ready although {why} (so since "
                    f"revision {since}); {tick}",
                )

    def on_write(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if kind == "Pod":
            if _identity(old) != _identity(new):
                doc = new or old
                assert doc is not None
                self.changed[doc["metadata"]["name"]] = self.store.revision
            self._handover(old, new)
            if self.grouped:
                self.on_pod_write(new or old)  # type: ignore[arg-type]
            self._track_gate()
            return
        if kind != "WeightRefit" or new is None:
            return
        if not times.stamp_of((old or {}).get("metadata") or {}) and times.stamp_of(
            new["metadata"]
        ):
            self._check_stamp(new)
        was = ((old or {}).get("status") or {}).get("phase")
        now = (new.get("status") or {}).get("phase")
        if now == "Succeeded" and was != "Succeeded":
            self._check_succeeded(new)
        elif now == "RolledBack" and was != "RolledBack":
            self._check_rolled_back(new)
        elif (
            now == "Superseded" and was != "Superseded" and _ready_reason(new) == Reason.PodsMovedOn
        ):
            self._check_moved_on(new)

    def _handover(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Trace a claim that passes from one operator process to another (a takeover)."""
        if old is None or new is None:
            return
        was = (old["metadata"].get("annotations") or {}).get(CLAIM_ANNOTATION)
        now = (new["metadata"].get("annotations") or {}).get(CLAIM_ANNOTATION)
        if was == now or not was or not now:
            return
        a, b = Claim.from_annotation(was), Claim.from_annotation(now)
        if a is not None and b is not None and a.holder != b.holder:
            self.note(
                f"pod {new['metadata']['name']}: claim of {a.refit} ({a.holder}) taken "
                f"over by {b.refit} ({b.holder}), fence {b.fence}"
            )

    def _check_stamp(self, refit: dict[str, Any]) -> None:
        """A creation stamp the operator writes orders the refit among those created in its
        second (docs/concepts.md, "Which refit is newer"): it must follow the order the API
        server stored them in."""
        self.checks += 1
        meta = refit["metadata"]
        me = self.store.created[meta["uid"]]
        for (kind, _, _), other in sorted(self.store.objects.items()):
            o = other["metadata"]
            if kind != "WeightRefit" or o["uid"] == meta["uid"] or not times.stamp_of(o):
                continue
            if o["creationTimestamp"] != meta["creationTimestamp"]:
                continue
            stored_first = self.store.created[o["uid"]] < me
            if stored_first != (times.order_of(o) < times.order_of(meta)):
                first, then = (o, meta) if stored_first else (meta, o)
                self.violate(
                    "creation-order",
                    f"refit {then['name']} is stamped {times.stamp_of(then)}, before "
                    f"{first['name']} ({times.stamp_of(first)}), which the API server stored "
                    "first in the same second",
                )

    def _since_listed(self) -> set[str]:
        """Pods changed (created, deleted, relabelled, restarted, moved) since the pod list
        the status being written was decided from: the next tick's to see."""
        listed = self.store.decided_from
        return {n for n, t in self.changed.items() if listed is not None and t > listed}

    def _selected(self, refit: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return [
            (name, doc) for (kind, _, name), doc in sorted(self.store.objects.items())
            if kind == "Pod" and not doc["metadata"].get("deletionTimestamp")
            and _selects(refit, doc["metadata"].get("labels") or {})
        ]  # fmt: skip

    def _said(self, message: str) -> None:
        self.violate("finished-says-served", message)

    def _check_rolled_back(self, refit: dict[str, Any]) -> None:
        """RolledBack says, per version, which pods went back to it ("N pods rolled back to
        V (a, b)"; decision._rollback) and which kept what they served: each such pod serves
        it, and every pod whose record is this refit's rollback pass, Succeeded, is named
        under its version. A pod changed since the list, restarted since its pass or taken
        up by a newer pass since cannot be blamed on this status."""
        self.checks += 1
        uid, name = refit["metadata"]["uid"], refit["metadata"]["name"]
        message = (refit.get("status") or {}).get("message", "")
        to: dict[str, str] = {}
        kept: set[str] = set()
        complete = True
        for part in message.split("; "):
            m = re.fullmatch(r"(\d+) pods rolled back to (.+?) \((.*)\)", part)
            k = re.fullmatch(r"(\d+) pods kept what they served \((.*)\)", part)
            if m is None and k is None and part != "no pod to roll back":
                self._said(
                    f"refit {name} RolledBack with a message part not understood: "
                    f"{part!r} (in {message!r})"
                )
                return
            if m is None and k is None:
                continue
            found = m or k
            assert found is not None
            count, names = int(found[1]), found[found.lastindex or 0]
            listed = re.fullmatch(r"(.*?)(?: and (\d+) more)?", names)
            assert listed is not None
            shown = listed[1].split(", ")
            more = int(listed[2] or 0)
            complete &= more == 0
            if count != len(shown) + more:
                self._said(
                    f"refit {name} RolledBack says {count} pods but names "
                    f"{len(shown)} and {more} more: {part!r}"
                )
            for pod in shown:
                if m is not None:
                    to[pod] = m[2]
                else:
                    kept.add(pod)
        since = self._since_listed()
        track = _track(refit)
        for pod_name, doc in self._selected(refit):
            if pod_name in since:
                continue
            p = _record(doc, track)
            if p is None or p.uid != uid:
                continue  # a newer pass took the pod up since (or never this refit's)
            restarts = sum(
                c.get("restartCount", 0) for c in doc["status"].get("containerStatuses") or []
            )
            serves = self._serves(doc, track)
            if pod_name in to:
                want = to[pod_name]
                if not (p.rollback and p.outcome == "Succeeded" and p.version == want):
                    self._said(
                        f"refit {name} RolledBack says pod {pod_name} rolled back to "
                        f"{want}; its record: rollback={p.rollback} {p.version} "
                        f"{p.outcome or 'in flight'}"
                    )
                elif p.restarts == restarts and serves != want:
                    self._said(
                        f"refit {name} RolledBack says pod {pod_name} rolled back to "
                        f"{want}, which serves {serves!r}"
                    )
            elif pod_name in kept:
                if p.restarts == restarts and p.serving and serves != p.serving:
                    self._said(
                        f"refit {name} RolledBack says pod {pod_name} kept what it "
                        f"served ({p.serving}), which serves {serves!r}"
                    )
            elif complete and p.rollback and p.outcome == "Succeeded":
                self._said(
                    f"refit {name} RolledBack rolled pod {pod_name} back to "
                    f"{p.version}, which its message does not say: {message!r}"
                )

    def _check_moved_on(self, refit: dict[str, Any]) -> None:
        """Superseded with PodsMovedOn ("every pod of this refit moved on to X";
        decision._progress): every pod the refit selected in the list the status was
        decided from is driven by a newer refit (its record is a newer refit's pass, not a
        rollback to this refit's version), and X is the newest of them. (What happened to
        the pods since is the next tick's to see: it takes back a pod no newer refit answers
        for, "the target again of".)"""
        self.checks += 1
        name, track = refit["metadata"]["name"], _track(refit)
        version = _version(refit)
        message = (refit.get("status") or {}).get("message", "")
        m = re.fullmatch(r"every pod of this refit moved on to (\S+)", message)
        if m is None:
            self._said(f"refit {name} Superseded ({Reason.PodsMovedOn}) says {message!r}")
            return
        # "Newer" in the one order the operator documents (docs/concepts.md, "Which refit is
        # newer"): creationTimestamp, the creation stamp, the name; a pod's record carries
        # its refit's (creation-order checks that the stamps follow the API server's order).
        mine = times.order_key(times.order_of(refit["metadata"]), name)
        listed = self.store.decided_pods
        pods = (
            self._selected(refit)
            if listed is None
            else [
                (d["metadata"]["name"], d) for d in listed
                if not d["metadata"].get("deletionTimestamp")
                and _selects(refit, d["metadata"].get("labels") or {})
            ]
        )  # fmt: skip
        drivers: list[tuple[tuple[str, str], str]] = []
        for pod_name, doc in pods:
            if _follower(doc) and refit["spec"]["fleet"].get("groups") is not None:
                continue  # its leader's record is the group's
            p = _record(doc, track)
            order = times.order_key(p.created, p.refit) if p is not None else ("", "")
            if p is None or order <= mine or (p.rollback and p.version == version):
                what = (
                    "no pass"
                    if p is None
                    else (f"{p.refit}'s {'rollback ' if p.rollback else ''}pass at {p.version}")
                )
                self._said(
                    f"refit {name} Superseded ({Reason.PodsMovedOn}: moved on to {m[1]}) while "
                    f"pod {pod_name} is driven by {what}, no newer refit"
                )
                return
            drivers.append((order, p.refit))
        if drivers and max(drivers)[1] != m[1]:
            self._said(
                f"refit {name} Superseded ({Reason.PodsMovedOn}) says its pods moved on to "
                f"{m[1]}; the newest that drives them is {max(drivers)[1]}"
            )

    def _check_succeeded(self, refit: dict[str, Any]) -> None:
        """The status is decided from a pod list the tick took before it wrote: a pod that
        changed since (deleted, replaced, relabelled, restarted) is the next tick's to see,
        and cannot be blamed on this status."""
        self.checks += 1
        version, track = _version(refit), _track(refit)
        uid, name = refit["metadata"]["uid"], refit["metadata"]["name"]
        listed = self.store.decided_from
        since = {n for n, t in self.changed.items() if listed is not None and t > listed}
        serving = 0
        for (kind, _, pod_name), doc in sorted(self.store.objects.items()):
            if kind != "Pod" or doc["metadata"].get("deletionTimestamp"):
                continue
            if not _selects(refit, doc["metadata"].get("labels") or {}):
                continue
            if pod_name in since:
                serving += 1
                since.discard(pod_name)
                continue
            serves = self._serves(doc, track)
            p = _record(doc, track)
            restarts = sum(
                c.get("restartCount", 0) for c in doc["status"].get("containerStatuses") or []
            )
            counted = p is not None and p.uid == uid and p.outcome == "Succeeded"
            # An adapter whose pod's base weights moved on to another version since: unloaded
            # by that base pass, and no longer this refit's to count (BaseChanged).
            counted = counted and not base_moved_on(PodView.from_pod(doc), p)
            # ... or whose pod another refit's base pass holds now: its drain unloads the
            # adapter (onBaseRefit: Unload), and the decision leaves the pod to that refit
            # (blocked), not counted here.
            base = _record(doc)
            held = bool(track) and base is not None and base.uid != uid and not base.finished_pass
            if (
                held
                and counted
                and listed is not None
                and int(doc["metadata"]["resourceVersion"]) > listed
            ):
                serving += 1  # that pass claimed it after the list this status was decided from
            counted = counted and not held
            # A container that restarted since its pass cannot be blamed on this status: the
            # tick decided from a list taken before (the restart is the next tick's to see).
            restarted = p is not None and p.restarts != restarts
            serving += serves == version or (counted and restarted)
            if counted and p is not None and p.restarts == restarts and serves != version:
                self.violate(
                    "succeeded-serving",
                    f"refit {name} Succeeded at {version} counting pod {pod_name}, which "
                    f"serves {serves!r}{f' under adapter {track}' if track else ''}",
                )
        serving += len(since)  # gone or no longer selected since the list
        updated = int((refit.get("status") or {}).get("updatedPods", 0))
        if updated > serving:
            self.violate(
                "succeeded-serving",
                f"refit {name} Succeeded with {updated} pods updated, but {serving} serve "
                f"{version}{f' under adapter {track}' if track else ''}",
            )

    # --------------------------------------------------------------------- liveness
    def targets(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Each pod's target per track (the base weights "", each adapter name): the newest
        Succeeded refit of that track that selects it now (creation order, never names),
        among the refits that exist and are not being deleted."""
        refits = [
            d for (k, _, _), d in self.store.objects.items()
            if k == "WeightRefit" and not d["metadata"].get("deletionTimestamp")
            and (d.get("status") or {}).get("phase") == "Succeeded"
        ]  # fmt: skip
        refits.sort(key=lambda d: self.store.created[d["metadata"]["uid"]])
        out = {}
        for (kind, _, name), doc in sorted(self.store.objects.items()):
            if kind != "Pod" or doc["metadata"].get("deletionTimestamp"):
                continue
            labels = doc["metadata"].get("labels") or {}
            for r in refits:
                if _selects(r, labels):
                    out[(name, _track(r))] = r  # the newest last
        return out

    def converged(self) -> str | None:
        """None when every pod serves its targets, Ready, and no refit is active; else what
        is not so yet. A pod group's follower serves through its leader: it is only Ready."""
        for (kind, _, name), doc in sorted(self.store.objects.items()):
            if kind == "WeightRefit" and (doc.get("status") or {}).get("phase", "") in ACTIVE:
                return f"refit {name} is still {(doc.get('status') or {}).get('phase', '')!r}"
        targets = self.targets()
        for (pod, track), refit in sorted(targets.items()):
            doc = self.store.objects[("Pod", refit["metadata"]["namespace"], pod)]
            if self._held_out(pod, doc, targets):
                continue
            if _follower(doc) and refit["spec"]["fleet"].get("groups") is not None:
                leader = self._leader_of(doc)
                if leader is not None and self._held_out(leader, self._pod(leader), targets):
                    continue  # out with its leader
                if not _gate(doc):
                    return f"member {pod} is not Ready ({_reason(doc)})"
                continue
            if track and self._not_expected(doc, track, refit):
                continue
            ip = doc["status"].get("podIP", "")
            want = _version(refit)
            serves = self._serves(doc, track)
            sim = self.sim.pods.get(ip)
            ready = _gate(doc) and sim is not None and sim.up and sim.ready_mark.ready
            if (serves != want or not ready) and not self._kept(doc, serves, ready, track):
                what = f"adapter {track} at " if track else ""
                return (
                    f"pod {pod} serves {what}{serves!r} (Ready={ready}, {_reason(doc)}); its "
                    f"target is {refit['metadata']['name']} at {want}; "
                    f"{self._last_pass(doc, track)}; records: {_said(_records(doc))}"
                    f"{self._refused(doc)}"
                )
        return None

    def _held_out(
        self, pod: str, doc: dict[str, Any], targets: dict[tuple[str, str], dict[str, Any]]
    ) -> bool:
        """Pods that stay out of traffic by design: one without a base target (nothing
        refits its base weights), and one a pass of another refit than its target failed on
        (docs/concepts.md, "Convergence": pods a newer refit failed stay out with their
        reason; an adapter whose swapped-in version failed, until the track is refit or
        rolled back); and, as docs/broadcast.md says, one that has nothing to roll back to
        (NoRollbackTarget), or whose base target is a Succeeded broadcast it did not receive
        in this run: each waits for the next refit. An adapter's pass refused before its swap
        changed nothing the pod serves: no excuse. (A group's record is of its run: every
        member's restarts.)"""
        if (pod, "") not in targets:
            return True  # no base weights to converge it to: nothing brings it back
        restarts = _restarts(doc)
        unit = self._units().get(pod)  # a group's record counts every member's restarts

        def this_run(p: Progress) -> bool:
            return unit.same_run(p) if unit is not None else p.restarts == restarts

        if _reason(doc) == Reason.NoRollbackTarget:
            return True  # served a broadcast (never loaded again): waits for the next refit
        base, mine = targets[(pod, "")], _record(doc)
        if "broadcast" in base["spec"] and not (
            mine is not None and mine.uid == base["metadata"]["uid"]
            and mine.outcome == "Succeeded" and this_run(mine)
        ):  # fmt: skip
            return True  # a Succeeded broadcast loads nobody again (joined, restarted)
        for track, p in _records(doc).items():
            target = targets.get((pod, track))
            if (
                target is not None
                and target["metadata"]["uid"] == p.uid
                and not base_moved_on(self._unit(doc), p)
            ):
                continue  # its target's own pass failed: the target tries it again
            # (An adapter whose pass failed on a base the pod no longer serves: no refit of it
            # is the pod's any more, and the failed record holds the pod out until one is.)
            if _failed(p) and this_run(p) and not _refused_in_traffic(p):
                return True
        return False

    def _pod(self, name: str) -> dict[str, Any]:
        return next(d for (k, _, n), d in self.store.objects.items() if k == "Pod" and n == name)

    def _leader_of(self, doc: dict[str, Any]) -> str | None:
        key = (doc["metadata"].get("labels") or {}).get(LWS_GROUP_LABEL)
        leaders = [m["metadata"]["name"] for m in self._group_members().get(key or "", [])
                   if not _follower(m) and not m["metadata"].get("deletionTimestamp")]  # fmt: skip
        return leaders[0] if len(leaders) == 1 else None

    def _not_expected(self, doc: dict[str, Any], track: str, target: dict[str, Any]) -> bool:
        """An adapter target the pod need not serve (docs/concepts.md, "One gate over many
        tracks and groups"): its record was probed on another base version than the pod
        serves now (a base pass unloaded it at its drain: the track needs a refit for the new
        base), or a newer pass of the track, refused, put back nothing of the target's (it served
        something else, or nothing, when it began). A pod that never had the track, or lost
        it to a restart, is its target's to converge."""
        p, unit = _record(doc, track), self._unit(doc)
        if p is None:
            return False
        if base_moved_on(unit, p):
            return True  # whatever run it was loaded in: its probe holds for another base
        if not unit.same_run(p):
            return False
        if p.uid != target["metadata"]["uid"] and p.outcome != "Succeeded":
            return not (p.restored and p.serving == _version(target))
        return False

    def _refused(self, doc: dict[str, Any]) -> str:
        """For liveness: the adapter refit refused before its swap that holds the pod out."""
        reason = _reason(doc)
        for track, p in sorted(_records(doc).items()):
            if _failed(p) and _refused_in_traffic(p) and p.reason == reason:
                return f"; held out by adapter {track}'s pass refused before its swap"
        return ""

    def _serves(self, doc: dict[str, Any], track: str) -> str | None:
        """What the pod's process serves of ``track``, intact (None: nothing, or wrong)."""
        ip = doc["status"].get("podIP", "")
        return self.sim.adapters(ip).get(track) if track else self.sim.serves(ip)

    def _kept(self, pod: dict[str, Any], serves: str | None, ready: bool, track: str = "") -> bool:
        """A pod that keeps the version of a newer refit that halted or was deleted, as
        docs/concepts.md ("Convergence") says it does: that refit's pass Succeeded on this
        container (no restart since), the pod serves that version, Ready. Its target takes
        it back only once it leaves traffic or restarts."""
        p = _record(pod, track)
        if p is None or p.rollback or not ready:
            return False
        # A pass refused before it touched the model put back (or never took away) what the
        # pod served: what it kept before, it keeps.
        untouched = p.restored or (p.outcome != "Succeeded" and _refused_in_traffic(p))
        kept = p.version if p.outcome == "Succeeded" else p.serving if untouched else None
        if kept is None:
            return False
        refit = next(
            (
                d
                for (k, _, _), d in self.store.objects.items()
                if k == "WeightRefit" and d["metadata"]["uid"] == p.uid
            ),
            None,
        )
        # (A rolled back refit needs nothing of a pod that its refused pass left serving.)
        ends = ("Halted", "Failed", "RolledBack") if untouched else ("Halted", "Failed")
        ended = refit is None or (refit.get("status") or {}).get("phase") in ends
        return ended and kept == serves and self._unit(pod).same_run(p)

    def _last_pass(self, pod: dict[str, Any], track: str = "") -> str:
        """The pod's last pass and what became of its refit (for the diagnosis)."""
        p = _record(pod, track)
        if p is None:
            return "no pass recorded"
        refit = next(
            (
                d
                for (k, _, _), d in self.store.objects.items()
                if k == "WeightRefit" and d["metadata"]["uid"] == p.uid
            ),
            None,
        )
        phase = "gone" if refit is None else (refit.get("status") or {}).get("phase", "")
        return f"last pass: {p.refit} at {p.version} ({p.outcome or 'in flight'}), refit {phase}"

    # --------------------------------------------------------------- bounded memory
    def check_memory(self, engines: Sequence[Engine]) -> None:
        """Nothing an engine keeps outlives the refits that exist."""
        self.checks += 1
        exist = {d["metadata"]["uid"] for (k, _, _), d in self.store.objects.items()
                 if k == "WeightRefit"}  # fmt: skip
        for eng in engines:
            ghosts = sorted(set(eng.index.known) - exist)
            stale = sorted(set(eng.refits) - exist)
            if ghosts or stale:
                self.violate(
                    "bounded-memory",
                    f"{eng.cluster.identity} keeps refits that are gone: index {ghosts}, "
                    f"state {stale}",
                )
