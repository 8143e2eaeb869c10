"""What `kubectl refit` prints, as text, from plain data (WeightRefit and Pod objects as
dicts): tables, a refit pod by pod, the plan, the history. Pure: the CLI (kubectl_plugin.py)
reads the cluster and hands the documents here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from refit_worker.contract import READINESS_GATE

from . import api, decision, groups, plan, times, traffic
from .podflow import Progress
from .podview import PodView
from .reasons import Problem
from .status import fleet_results


def reason_of(status: Mapping[str, Any]) -> Problem:
    """The operator's reason and message for the refit's current phase."""
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    phase = status.get("phase", "")
    # Degraded carries the failure reason; Ready carries it too when Degraded is not set
    # (Superseded is not degraded, but not ready either).
    for ctype in ("Degraded", "Ready"):
        c = conds.get(ctype)
        if c and c.get("status") == ("True" if ctype == "Degraded" else "False"):
            return Problem(
                str(c.get("reason", phase)), str(c.get("message", status.get("message", "")))
            )
    return Problem(str(phase), str(status.get("message", "")))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned with two spaces, as kubectl prints them."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _num(x: object, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, int | float) else "-"


def age(text: str, now: datetime | None = None) -> str:
    """kubectl-style short age: 45s, 3m12s, 2h5m, 4d."""
    t = times.parse(text)
    if t is None:
        return "-"
    return duration(((now or datetime.now(UTC)) - t).total_seconds())


def duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d"


def seconds(x: float | None) -> str:
    """A time out of traffic: 0.41s, 12.3s, 4m12s; "-" when there is none."""
    if x is None:
        return "-"
    if x < 10:
        return f"{x:.2f}s"
    if x < 120:
        return f"{x:.1f}s"
    return duration(x)


def _own_records(doc: Mapping[str, Any], views: Sequence[PodView]) -> dict[str, Progress]:
    """Pod name -> progress, for the pods whose record is this refit's pass."""
    uid = str((doc.get("metadata") or {}).get("uid", ""))
    return {v.name: v.progress for v in views if v.progress is not None and v.progress.uid == uid}


def pod_rows(
    doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]] = ()
) -> list[list[object]]:
    """One row per pod: every pod of the fleet from its own record (the progress annotation),
    folded with the refit's status.pods, which lists only the pods that need attention (and
    alone remembers pods deleted mid-refit)."""
    status = api.WeightRefitStatus.model_validate(doc.get("status") or {})
    views = units(doc, fleet_pods)
    gates = {str(p["metadata"]["name"]): _gate(p) for p in fleet_pods}
    # A pod group's gate is the group's: "yes" only when every pod of it is in traffic.
    ready = {v.name: ("yes" if v.ready else "no") if v.members else gates[v.name] for v in views}
    uid = str((doc.get("metadata") or {}).get("uid", ""))
    own = _own_records(doc, views)
    rows: list[list[object]] = []
    for r in fleet_results(status.pods, views, uid):
        probe = r.probe
        out = r.out_of_traffic_seconds
        if out is None and r.name in own:  # a result made by an operator older than the field
            out = traffic.pod_seconds(own[r.name])
        rows.append([
            r.name, r.phase, r.step or "-", r.version or "-",
            ready.get(r.name, "-"), r.attempts, probe.verdict if probe else "-",
            _num(_recorded(probe, "nll")), _num(_recorded(probe, "reference_nll")),
            _num(_recorded(probe, "mean_abs_logprob_diff")),
            _num(_recorded(probe, "max_abs_logprob_diff")),
            (r.checksum or "-")[:CHECKSUM_SHOWN], seconds(out), r.reason,
        ])  # fmt: skip
    return rows


def units(doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]]) -> list[PodView]:
    """The refit's units as the operator counts them (core/groups.py): each pod, or with
    spec.fleet.groups each pod group as its leader, so a follower (which carries no record)
    is never shown as a pod of its own."""
    fleet = (doc.get("spec") or {}).get("fleet") or {}
    grouping = fleet.get("groups")
    by = api.Groups.model_validate(grouping) if grouping is not None else None
    return groups.units(pod_views(doc, fleet_pods), by)


def pod_views(doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]]) -> list[PodView]:
    """The pods with the records of the weights the refit replaces (PodView.on_track): an
    adapter refit's, or the base weights'."""
    return [PodView.from_pod(p).on_track(track_of(doc)) for p in fleet_pods]


def _recorded(probe: api.PodProbe | None, name: str) -> object:
    """A probe's number as recorded: None (printed "-", not as a default 0) when the record
    does not hold it."""
    return getattr(probe, name) if probe is not None and name in probe.model_fields_set else None


def out_of_traffic(
    doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]] = ()
) -> api.OutOfTrafficSummary:
    """The refit's time out of traffic: status.outOfTraffic, or, when the pods' records of
    this refit measure more pods (an operator older than the field), the summary of those."""
    status = api.WeightRefitStatus.model_validate(doc.get("status") or {})
    own = _own_records(doc, pod_views(doc, fleet_pods))
    live = traffic.summarize_out_of_traffic(own.items())
    return live if live.pods > status.out_of_traffic.pods else status.out_of_traffic


def _gate(pod: Mapping[str, Any]) -> str:
    """The pod's weights-ready condition as yes / no / - (not set)."""
    conds = (pod.get("status") or {}).get("conditions") or []
    gate = next((c.get("status") for c in conds if c.get("type") == READINESS_GATE), "")
    return {"True": "yes", "False": "no"}.get(gate, "-")


POD_HEADERS = ("POD", "PHASE", "STEP", "VERSION", "READY", "ATTEMPTS", "PROBE", "NLL",
               "REF-NLL", "MEAN|Δ|", "MAX|Δ|", "CHECKSUM", "OUT-OF-TRAFFIC", "REASON")  # fmt: skip
CHECKSUM_SHOWN = 12  # hex digits of a read-back checksum in tables: enough to tell pods apart


def version_of(doc: Mapping[str, Any]) -> str:
    """A WeightRefit document's version, whatever its weight source (checkpoint, broadcast or
    adapter)."""
    spec = doc.get("spec") or {}
    source = spec.get("checkpoint") or spec.get("broadcast") or spec.get("adapter") or {}
    return str(source.get("version", "?"))


def describe(doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]] = ()) -> str:
    """One refit: a header (version, phase, counts, reason, message) and the per-pod table."""
    meta, spec, status = doc["metadata"], doc.get("spec") or {}, doc.get("status") or {}
    phase = status.get("phase") or "Pending"
    strat = spec.get("strategy") or {}
    why = reason_of(status) if status else Problem("", "")
    reason, message = why.reason, why.message
    lines = [
        f"WeightRefit {meta['namespace']}/{meta['name']}: {version_of(doc)} "
        f"({strat.get('type', 'AllAtOnce')}, canary {strat.get('canary', 0)}) "
        f"on fleet {status.get('fleet') or fleet_of(doc)}",
        f"Phase: {phase}   Updated: {status.get('updatedPods', 0)}/{status.get('targetPods', 0)}"
        f"   Failed: {status.get('failedPods', 0)}"
        f"   Inconclusive: {status.get('inconclusivePods', 0)}",
    ]
    oot = out_of_traffic(doc, fleet_pods)
    if oot.pods:
        lines.append(
            f"Out of traffic: worst {seconds(oot.worst_seconds)} ({oot.worst_pod}), "
            f"median {seconds(oot.median_seconds)} over {oot.pods} pod(s) put back"
        )
    if reason and reason != phase:
        lines.append(f"Reason: {reason}")
    if message:
        lines.append(f"Message: {message}")
    prev = status.get("previous") or {}
    if prev.get("version"):
        lines.append(f"Previous: {prev['version']} (from {prev.get('refit') or '?'})")
    agreed = [
        f"{c['version']} ({c['layout']}): {str(c['digest'])[:CHECKSUM_SHOWN]}"
        for c in status.get("checksums") or []
    ]
    if agreed:
        lines.append(f"Checksums: {', '.join(agreed)}")
    rows = pod_rows(doc, fleet_pods)
    lines.append("")
    lines.append(table(POD_HEADERS, rows) if rows else "no pods yet")
    moved, others = _other_records(doc, fleet_pods)
    if moved and phase in api.TERMINAL_PHASES:
        lines.append(
            f"{moved} pod(s) shown Pending carry another refit's record now "
            f"({', '.join(others)}): this refit's result for them is not kept."
        )
    return "\n".join(lines)


def _other_records(
    doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]]
) -> tuple[int, list[str]]:
    """Pods the status does not list whose record is another refit's pass, and those refits."""
    uid = (doc.get("metadata") or {}).get("uid", "")
    listed = {p.get("name") for p in (doc.get("status") or {}).get("pods") or []}
    names = []
    for view in pod_views(doc, fleet_pods):
        if view.progress is not None and view.progress.uid != uid and view.name not in listed:
            names.append(view.progress.refit)
    return len(names), sorted(set(names))


def refit_rows(
    docs: Sequence[Mapping[str, Any]], now: datetime | None = None
) -> list[list[object]]:
    rows: list[list[object]] = []
    for d in docs:
        st = d.get("status") or {}
        reason = reason_of(st).reason if st else ""
        rows.append([
            d["metadata"]["name"], version_of(d), st.get("phase") or "Pending",
            f"{st.get('updatedPods', 0)}/{st.get('targetPods', 0)}", st.get("failedPods", 0),
            _num((st.get("probeSummary") or {}).get("worstMaxAbsLogprobDiff")),
            reason if reason != st.get("phase") else "",
            age(d["metadata"]["creationTimestamp"], now),
        ])  # fmt: skip
    return rows


REFIT_HEADERS = ("NAME", "VERSION", "PHASE", "UPDATED", "FAILED", "WORST|Δ|", "REASON", "AGE")


# ----------------------------------------------------------------------------------- plan
def plan_batches(
    refit: decision.RefitView, pods: Sequence[decision.PodView]
) -> tuple[list[str], list[list[str]], list[str]]:
    """(pods in flight now, batches still to start in order, pods already at the version),
    from the operator's own decisions, assuming every pod passes its probe."""
    version = refit.spec.version
    states = {p.name: decision.pod_state(p, refit, version, rollback=False) for p in pods}
    states = {n: s for n, s in states.items() if s != "dropped"}
    done = sorted(n for n, s in states.items() if s == "passed")
    active = sorted(n for n, s in states.items() if s == "active")
    states = {n: ("passed" if s == "active" else s) for n, s in states.items()}
    batches = []
    while True:
        batch = plan.next_pods(states, refit.spec.strategy)
        if not batch:
            break
        batches.append(batch)
        states.update(dict.fromkeys(batch, "passed"))
    return active, batches, done


def plan_report(
    doc: Mapping[str, Any],
    pod_docs: Sequence[Mapping[str, Any]],
    fleet_refits: Sequence[Mapping[str, Any]],
) -> str:
    meta = doc["metadata"]
    spec = api.WeightRefitSpec.model_validate(doc["spec"])
    status = api.WeightRefitStatus.model_validate(doc.get("status") or {})
    view = decision.RefitView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), generation=1,
        created=times.order_of(meta) or "9999", spec=spec, status=status,
    )  # fmt: skip
    pods = sorted(units(doc, pod_docs), key=lambda p: p.name)
    strat = spec.strategy
    width = (
        len(pods)
        if strat.type == "AllAtOnce"
        else api.max_unavailable_count(strat.max_unavailable, len(pods))
    )
    version = spec.version
    out = [
        f"WeightRefit {meta.get('name') or '(new)'}: {version} from {_source(spec)}",
        f"Fleet {spec.fleet.selector.canonical()}: {len(pods)} pods; strategy {strat.type}"
        + (
            f", maxUnavailable {strat.max_unavailable} -> {width} at a time"
            if strat.type == "Rolling"
            else ""
        )
        + (f", canary {strat.canary}" if strat.canary else "")
        + f"; onFailure {spec.on_failure}",
    ]
    if status.phase in api.TERMINAL_PHASES:
        out.append(f"Note: this refit already ended ({status.phase}); the plan shows what a new "
                   "refit with this spec would do now.")  # fmt: skip
    problems = []
    for p in pods:
        if not p.has_gate:
            problems.append(
                f"{p.name}: no readiness gate {READINESS_GATE} "
                "(preflight fails: MissingReadinessGate)"
            )
        if not p.running or not p.ip:
            problems.append(f"{p.name}: not Running with a pod IP (preflight fails: PodNotRunning)")
    if not pods:
        problems.append("the selector matches no pods (preflight fails: NoPodsSelected)")
    refs = [
        plan.RefitRef(r["metadata"]["name"], times.order_of(r["metadata"]),
                      (r.get("status") or {}).get("phase", "Pending"),
                      r["spec"].get("queuePolicy", "Queue"))
        for r in fleet_refits if r["metadata"]["name"] != meta.get("name")
    ]  # fmt: skip
    me = plan.RefitRef(view.name or "(new)", view.created, status.phase, spec.queue_policy)
    role = plan.queue_role(me, [*refs, me])
    if role.role == "queued":
        ahead = [r.name for r in refs if r.phase not in api.TERMINAL_PHASES]
        out.append(
            f"Queue: waits behind {role.position} refit(s) of this fleet ({', '.join(ahead)})"
        )
    elif role.role == "superseded":
        out.append(f"Queue: superseded by {role.superseded_by} (LatestWins); nothing would run")
    active, batches, done = plan_batches(view, pods)
    out.append("")
    rows: list[list[object]] = []
    if active:
        rows.append(["in flight", ", ".join(active)])
    canaries = min(strat.canary, len(pods))
    for i, batch in enumerate(batches, 1):
        label = f"batch {i}"
        if i == 1 and canaries and not done and not active:
            label += " (canary: must pass before the rest)"
        rows.append([label, ", ".join(batch)])
    if done:
        rows.append([f"already at {version}", ", ".join(done)])
    out.append(table(("STEP", "PODS"), rows) if rows else "nothing to do")
    if strat.type == "Rolling" and len(batches) > 1:
        out.append(f"(a rolling refit starts the next pod as soon as one of the {width} "
                   "in flight passes; batches show the order and the width)")  # fmt: skip
    if problems:
        out.append("")
        out.append("Preflight would stop this refit before touching any pod:")
        out.extend(f"  {p}" for p in problems)
    return "\n".join(out)


# ------------------------------------------------------------------------------- history
def history_rows(docs: Sequence[Mapping[str, Any]]) -> list[list[object]]:
    refs = [
        plan.RefitRef(d["metadata"]["name"], times.order_of(d["metadata"]),
                      (d.get("status") or {}).get("phase", "Pending"))
        for d in docs
    ]  # fmt: skip
    current = plan.fleet_target(refs)
    rows: list[list[object]] = []
    for d in docs:
        st = d.get("status") or {}
        start, end = times.parse(st.get("startTime", "")), times.parse(st.get("completionTime", ""))
        took = duration((end - start).total_seconds()) if start and end else "-"
        reason = reason_of(st).reason if st else ""
        rows.append([
            ("* " if d["metadata"]["name"] == current else "  ") + d["metadata"]["name"],
            version_of(d), st.get("phase") or "Pending",
            reason if reason != st.get("phase") else "",
            f"{st.get('updatedPods', 0)}/{st.get('targetPods', 0)}",
            (st.get("previous") or {}).get("version") or "-",
            st.get("startTime") or "-", took,
        ])  # fmt: skip
    return rows


HISTORY_HEADERS = ("  NAME", "VERSION", "OUTCOME", "REASON", "UPDATED", "FROM", "STARTED", "TOOK")


def fleet_of(doc: Mapping[str, Any]) -> str:
    return api.LabelSelector.model_validate(doc["spec"]["fleet"]["selector"]).canonical()


def track_of(doc: Mapping[str, Any]) -> str:
    """The weights a WeightRefit document replaces (WeightRefitSpec.track): "" for the base
    weights, else the adapter's name. Refits of one selector and track are one fleet."""
    return str(((doc.get("spec") or {}).get("adapter") or {}).get("name", ""))


def _source(spec: api.WeightRefitSpec) -> str:
    if spec.adapter is not None:
        return f"LoRA adapter {spec.adapter.name!r} at {spec.path}"
    if spec.broadcast is None:
        return spec.path
    r = spec.broadcast.rendezvous
    return f"a {spec.broadcast.engine} broadcast by the trainer at {r.host}:{r.port}"
