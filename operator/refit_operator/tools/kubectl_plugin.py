"""`kubectl refit`: status, plan, wait and history of WeightRefits (installed as kubectl-refit).

    kubectl refit status [NAME]            refits of the namespace, or one refit pod by pod
    kubectl refit plan NAME | -f FILE      which pods would be refitted in which batches
    kubectl refit wait NAME [--timeout 10m]
    kubectl refit history [NAME | -l SELECTOR]

Read only: nothing here writes to the cluster (`plan -f` asks the API server for a
server-side dry run, which validates and defaults the file without storing it). `plan` runs
the operator's own pure planning code (plan.next_pods, decision.pod_state) on the pods as
they are now, so what it prints is what the operator would do.

Exit codes of `wait`: 0 Succeeded, 1 Failed/Halted/RolledBack/Superseded, 124 timed out;
every command exits 2 on bad usage or when the API server cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from refit_worker.contract import API_GROUP

from ..core import api
from ..core.views import (
    HISTORY_HEADERS,
    REFIT_HEADERS,
    describe,
    fleet_of,
    history_rows,
    plan_report,
    refit_rows,
    table,
    track_of,
)
from .client import RefitClient, RefitFailed, RefitTimeout
from .refit_document import parse_selector
from .refit_error import RefitError

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124


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
        selector, track = fleet_of(doc), track_of(doc)
        fleet_refits = [r for r in self.refits.list_refits()
                        if fleet_of(r) == selector and track_of(r) == track]  # fmt: skip
        self.print(plan_report(doc, self.fleet_pods(selector), fleet_refits))
        return 0

    def dry_run(self, body: dict[str, Any]) -> dict[str, Any]:
        """The API server's validation and defaults, without storing anything."""
        body.setdefault("metadata", {}).setdefault("namespace", self.ns)
        if not body["metadata"].get("name") and not body["metadata"].get("generateName"):
            body["metadata"]["generateName"] = "plan-"
        try:
            doc: dict[str, Any] = self.refits.custom.create_namespaced_custom_object(
                API_GROUP, api.VERSION, self.ns, api.PLURAL, body, dry_run="All"
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
        # One block per fleet: its selector, and the adapter of an adapter refit's track.
        fleets: dict[str, list[dict[str, Any]]] = {}
        for d in docs:
            track = track_of(d)
            fleets.setdefault(fleet_of(d) + (f" adapter={track}" if track else ""), []).append(d)
        if selector is not None:
            want = selector if name is not None else parse_selector(selector).canonical()
            fleets = {k: v for k, v in fleets.items() if fleet_of(v[0]) == want}
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
