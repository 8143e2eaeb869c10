"""`kubectl refit`: status, plan, wait and history of WeightRefits (installed as kubectl-refit).

    kubectl refit status [NAME]            refits of the namespace, or one refit pod by pod
    kubectl refit plan NAME | -f FILE      which pods would be refitted in which batches
    kubectl refit wait NAME [--timeout 10m]
    kubectl refit history [NAME | -l SELECTOR]

Read only: nothing here writes to the cluster (`plan -f` asks the API server for a
server-side dry run, which validates and defaults the file without storing it). `plan` runs
the operator's own pure planning code (plan.next_pods, reconcile.pod_state) on the pods as
they are now, so what it prints is what the operator would do.

Exit codes of `wait`: 0 Succeeded, 1 Failed/Halted/RolledBack/Superseded, 124 timed out;
every command exits 2 on bad usage or when the API server cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from . import api, plan, reconcile
from .client import (
    RefitClient,
    RefitError,
    RefitFailed,
    RefitTimeout,
    parse_selector,
    reason_of,
)
from .cluster import CONDITION, pod_view

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124


# ------------------------------------------------------------------------------ formatting
def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned with two spaces, as kubectl prints them."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _num(x: object, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, int | float) else "-"


def _parse_time(text: str) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def age(text: str, now: datetime | None = None) -> str:
    """kubectl-style short age: 45s, 3m12s, 2h5m, 4d."""
    t = _parse_time(text)
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


def parse_timeout(text: str) -> float:
    """600, 600s, 10m, 1h, 1h30m."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s?)?", text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 10m, 1h)")
    h, mi, s = m.groups()
    total = int(h or 0) * 3600 + int(mi or 0) * 60 + float(s or 0)
    if total <= 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    return total


# --------------------------------------------------------------------------- status views
def pod_rows(
    doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]] = ()
) -> list[list[object]]:
    """One row per pod: every pod of the fleet from its own record (the progress annotation),
    folded with the refit's status.pods, which lists only the pods that need attention (and
    alone remembers pods deleted mid-refit)."""
    status = api.WeightRefitStatus.model_validate(doc.get("status") or {})
    views = [pod_view(dict(p)) for p in fleet_pods]
    ready = {v.name: _gate(p) for v, p in zip(views, fleet_pods, strict=True)}
    uid = str((doc.get("metadata") or {}).get("uid", ""))
    rows: list[list[object]] = []
    for r in reconcile.fleet_results(status.pods, views, uid):
        # As recorded: a number the record does not have prints as "-", not as a default 0.
        p = r.model_dump(by_alias=True, mode="json", exclude_unset=True, exclude_none=True)
        probe = p.get("probe") or {}
        rows.append([
            r.name, r.phase, p.get("step") or "-", p.get("version") or "-",
            ready.get(r.name, "-"), p.get("attempts", 0), probe.get("verdict", "-"),
            _num(probe.get("nll")), _num(probe.get("referenceNll")),
            _num(probe.get("meanAbsLogprobDiff")), _num(probe.get("maxAbsLogprobDiff")),
            p.get("reason") or "",
        ])  # fmt: skip
    return rows


def _gate(pod: Mapping[str, Any]) -> str:
    """The pod's weights-ready condition as yes / no / - (not set)."""
    conds = (pod.get("status") or {}).get("conditions") or []
    gate = next((c.get("status") for c in conds if c.get("type") == CONDITION), "")
    return {"True": "yes", "False": "no"}.get(gate, "-")


POD_HEADERS = ("POD", "PHASE", "STEP", "VERSION", "READY", "ATTEMPTS", "PROBE", "NLL",
               "REF-NLL", "MEAN|Δ|", "MAX|Δ|", "REASON")  # fmt: skip


def describe(doc: Mapping[str, Any], fleet_pods: Sequence[Mapping[str, Any]] = ()) -> str:
    """One refit: a header (version, phase, counts, reason, message) and the per-pod table."""
    meta, spec, status = doc["metadata"], doc.get("spec") or {}, doc.get("status") or {}
    phase = status.get("phase") or "Pending"
    strat = spec.get("strategy") or {}
    reason, message = reason_of(status) if status else ("", "")
    lines = [
        f"WeightRefit {meta['namespace']}/{meta['name']}: {spec['checkpoint']['version']} "
        f"({strat.get('type', 'AllAtOnce')}, canary {strat.get('canary', 0)}) "
        f"on fleet {status.get('fleet') or fleet_of(doc)}",
        f"Phase: {phase}   Updated: {status.get('updatedPods', 0)}/{status.get('targetPods', 0)}"
        f"   Failed: {status.get('failedPods', 0)}"
        f"   Inconclusive: {status.get('inconclusivePods', 0)}",
    ]
    if reason and reason != phase:
        lines.append(f"Reason: {reason}")
    if message:
        lines.append(f"Message: {message}")
    prev = status.get("previous") or {}
    if prev.get("version"):
        lines.append(f"Previous: {prev['version']} (from {prev.get('refit') or '?'})")
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
    for p in fleet_pods:
        view = pod_view(dict(p))
        if view.progress is not None and view.progress.uid != uid and view.name not in listed:
            names.append(view.progress.refit)
    return len(names), sorted(set(names))


def refit_rows(
    docs: Sequence[Mapping[str, Any]], now: datetime | None = None
) -> list[list[object]]:
    rows: list[list[object]] = []
    for d in docs:
        st = d.get("status") or {}
        reason = reason_of(st)[0] if st else ""
        rows.append([
            d["metadata"]["name"], d["spec"]["checkpoint"]["version"], st.get("phase") or "Pending",
            f"{st.get('updatedPods', 0)}/{st.get('targetPods', 0)}", st.get("failedPods", 0),
            _num((st.get("probeSummary") or {}).get("worstMaxAbsLogprobDiff")),
            reason if reason != st.get("phase") else "",
            age(d["metadata"]["creationTimestamp"], now),
        ])  # fmt: skip
    return rows


REFIT_HEADERS = ("NAME", "VERSION", "PHASE", "UPDATED", "FAILED", "WORST|Δ|", "REASON", "AGE")


# ----------------------------------------------------------------------------------- plan
def plan_batches(
    refit: reconcile.RefitView, pods: Sequence[reconcile.PodView]
) -> tuple[list[str], list[list[str]], list[str]]:
    """(pods in flight now, batches still to start in order, pods already at the version),
    from the operator's own decisions, assuming every pod passes its probe."""
    version = refit.spec.checkpoint.version
    states = {p.name: reconcile.pod_state(p, refit, version, rollback=False) for p in pods}
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
    view = reconcile.RefitView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), generation=1,
        created=meta.get("creationTimestamp") or "9999", spec=spec, status=status,
    )  # fmt: skip
    pods = sorted((pod_view(dict(p)) for p in pod_docs), key=lambda p: p.name)
    strat = spec.strategy
    width = (
        len(pods)
        if strat.type == "AllAtOnce"
        else api.max_unavailable_count(strat.max_unavailable, len(pods))
    )
    version = spec.checkpoint.version
    out = [
        f"WeightRefit {meta.get('name') or '(new)'}: {version} from {spec.checkpoint.path}",
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
                f"{p.name}: no readiness gate {CONDITION} (preflight fails: MissingReadinessGate)"
            )
        if not p.running or not p.ip:
            problems.append(f"{p.name}: not Running with a pod IP (preflight fails: PodNotRunning)")
    if not pods:
        problems.append("the selector matches no pods (preflight fails: NoPodsSelected)")
    refs = [
        plan.RefitRef(r["metadata"]["name"], r["metadata"]["creationTimestamp"],
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
        plan.RefitRef(d["metadata"]["name"], d["metadata"]["creationTimestamp"],
                      (d.get("status") or {}).get("phase", "Pending"))
        for d in docs
    ]  # fmt: skip
    current = plan.fleet_target(refs)
    rows: list[list[object]] = []
    for d in docs:
        st = d.get("status") or {}
        start, end = _parse_time(st.get("startTime", "")), _parse_time(st.get("completionTime", ""))
        took = duration((end - start).total_seconds()) if start and end else "-"
        reason = reason_of(st)[0] if st else ""
        rows.append([
            ("* " if d["metadata"]["name"] == current else "  ") + d["metadata"]["name"],
            d["spec"]["checkpoint"]["version"], st.get("phase") or "Pending",
            reason if reason != st.get("phase") else "",
            f"{st.get('updatedPods', 0)}/{st.get('targetPods', 0)}",
            (st.get("previous") or {}).get("version") or "-",
            st.get("startTime") or "-", took,
        ])  # fmt: skip
    return rows


HISTORY_HEADERS = ("  NAME", "VERSION", "OUTCOME", "REASON", "UPDATED", "FROM", "STARTED", "TOOK")


def fleet_of(doc: Mapping[str, Any]) -> str:
    return api.LabelSelector.model_validate(doc["spec"]["fleet"]["selector"]).canonical()


# ------------------------------------------------------------------------------ commands
class Plugin:
    def __init__(self, refits: RefitClient, out: TextIO) -> None:
        self.refits = refits
        self.core: Any = k8s.CoreV1Api(refits.api_client)
        self.out = out

    @property
    def ns(self) -> str:
        return self.refits.namespace

    def print(self, text: str) -> None:
        self.out.write(text + "\n")

    def fleet_pods(self, selector: str) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            self.ns, label_selector=selector, _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return items

    def status(self, name: str | None) -> int:
        if name is None:
            docs = self.refits.list_refits()
            if not docs:
                self.print(f"No WeightRefits in namespace {self.ns}.")
                return 0
            self.print(table(REFIT_HEADERS, refit_rows(docs)))
            return 0
        doc = self.refits.get(name)
        self.print(describe(doc, self.fleet_pods(fleet_of(doc))))
        return 0

    def plan(self, name: str | None, file: str | None) -> int:
        if file is not None:
            doc = self.dry_run(_read_manifest(file))
        else:
            assert name is not None
            doc = self.refits.get(name)
        selector = fleet_of(doc)
        fleet_refits = [r for r in self.refits.list_refits() if fleet_of(r) == selector]
        self.print(plan_report(doc, self.fleet_pods(selector), fleet_refits))
        return 0

    def dry_run(self, body: dict[str, Any]) -> dict[str, Any]:
        """The API server's validation and defaults, without storing anything."""
        body.setdefault("metadata", {}).setdefault("namespace", self.ns)
        if not body["metadata"].get("name") and not body["metadata"].get("generateName"):
            body["metadata"]["generateName"] = "plan-"
        try:
            doc: dict[str, Any] = self.refits.custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, self.ns, api.PLURAL, body, dry_run="All"
            )
        except ApiException as e:
            if e.status == 409:  # exists: validate as if new, under a throwaway name
                body["metadata"].pop("name")
                body["metadata"]["generateName"] = "plan-"
                return self.dry_run(body)
            raise RefitError(f"the API server rejects this WeightRefit: {_message(e)}") from e
        doc["metadata"]["creationTimestamp"] = "9999-12-31T23:59:59Z"  # not created: newest
        return doc

    def wait(self, name: str, timeout: float) -> int:
        try:
            st = self.refits.wait(name, timeout)
        except RefitFailed as e:
            why = f" (after {e.cause})" if e.cause != e.reason else ""
            self.print(f"weightrefit/{name}: {e.phase}: {e.reason}{why}: {e.message}")
            for f in e.pod_failures:
                self.print(f"  {f.pod}: {f.phase} {f.reason}: {f.message}")
            return EXIT_FAILED
        except RefitTimeout as e:
            self.print(f"weightrefit/{name}: {e}")
            return EXIT_TIMEOUT
        self.print(f"weightrefit/{name}: Succeeded: {st.get('message', '')}")
        return 0

    def history(self, name: str | None, selector: str | None) -> int:
        docs = self.refits.list_refits()
        if name is not None:
            selector = fleet_of(self.refits.get(name))
        fleets: dict[str, list[dict[str, Any]]] = {}
        for d in docs:
            fleets.setdefault(fleet_of(d), []).append(d)
        if selector is not None:
            want = selector if name is not None else parse_selector(selector).canonical()
            fleets = {k: v for k, v in fleets.items() if k == want}
        if not fleets:
            which = f" for fleet {selector}" if selector else ""
            self.print(f"No WeightRefits in namespace {self.ns}{which}.")
            return 0
        blocks = []
        for fleet, items in sorted(fleets.items()):
            blocks.append(f"Fleet {fleet} (* = the version the fleet converges to)\n"
                          + table(HISTORY_HEADERS, history_rows(items)))  # fmt: skip
        self.print("\n\n".join(blocks))
        return 0


def _message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "").get("message") or e.reason)
    except ValueError:
        return f"HTTP {e.status} {e.reason}"


def _read_manifest(file: str) -> dict[str, Any]:
    text = sys.stdin.read() if file == "-" else Path(file).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    refits = [d for d in docs if isinstance(d, dict) and d.get("kind") == api.KIND]
    if len(refits) != 1:
        raise RefitError(f"{file}: expected exactly one WeightRefit, found {len(refits)}")
    return refits[0]


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS)
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS)
    common.add_argument("--context", default=argparse.SUPPRESS)
    p = argparse.ArgumentParser(
        prog="kubectl refit", parents=[common],
        description="Status, plans, waiting and history of WeightRefits (read only).",
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", parents=[common], help="all refits, or one refit pod by pod")
    s.add_argument("name", nargs="?")
    s = sub.add_parser("plan", parents=[common], help="which pods would go in which batch")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("name", nargs="?")
    g.add_argument("-f", "--filename", help="a WeightRefit manifest (- for stdin); dry-run only")
    s = sub.add_parser("wait", parents=[common], help="wait for a refit's verdict")
    s.add_argument("name")
    s.add_argument("--timeout", type=parse_timeout, default=parse_timeout("10m"),
                   help="e.g. 90s, 10m, 1h (default 10m)")  # fmt: skip
    s = sub.add_parser("history", parents=[common], help="refits of a fleet and their outcomes")
    s.add_argument("name", nargs="?", help="show the fleet of this refit")
    s.add_argument("-l", "--selector", help="the fleet's label selector, e.g. app=rollout")
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    out = out or sys.stdout
    try:
        refits = RefitClient(
            namespace=getattr(args, "namespace", None),
            kubeconfig=getattr(args, "kubeconfig", None),
            context=getattr(args, "context", None),
        )
    except RefitError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    plugin = Plugin(refits, out)
    commands: dict[str, Callable[[], int]] = {
        "status": lambda: plugin.status(args.name),
        "plan": lambda: plugin.plan(args.name, args.filename),
        "wait": lambda: plugin.wait(args.name, args.timeout),
        "history": lambda: plugin.history(args.name, args.selector),
    }
    try:
        return commands[args.command]()
    except (RefitError, ApiException, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        refits.close()


if __name__ == "__main__":
    sys.exit(main())
