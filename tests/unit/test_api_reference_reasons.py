"""Every reason the operator can report is explained in docs/troubleshooting.md.

Reasons are CamelCase string literals in the operator's decision and I/O modules, the
worker's rejection codes (contract.REJECTION_CODES), and the per-step timeout reasons the
runner builds from the step names. A new reason without a doc entry fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from refit_operator import podflow
from refit_worker import contract

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "troubleshooting.md"
MODULES = ("api", "plan", "podflow", "probe", "reconcile", "runner", "engine", "cluster",
           "handlers", "worker")  # fmt: skip
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
# CamelCase literals that are spec values, API names or prefixes, not reasons.
NOT_REASONS = {"AllAtOnce", "LatestWins", "ConfigMap", "DoesNotExist", "NotIn", "WeightRefit",
               "BearerToken", "InProgress", "PodRefit", "ContainersReady"}  # fmt: skip


def operator_reasons() -> set[str]:
    found = set()
    for name in MODULES:
        path = REPO / "operator" / "refit_operator" / f"{name}.py"
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if CAMEL.match(node.value):
                    found.add(node.value)
    timeouts = {f"{s[0].upper()}{s[1:]}Timeout" for s in podflow.STEPS if s != "ready"}
    return (found - NOT_REASONS) | set(contract.REJECTION_CODES) | timeouts


def test_the_scan_finds_reasons():
    reasons = operator_reasons()
    assert {"FailureLimitExceeded", "NllDrift", "ManifestMismatch", "LoadTimeout"} <= reasons


def test_every_reason_is_in_the_troubleshooting_doc():
    doc = DOC.read_text()
    missing = sorted(r for r in operator_reasons() if f"`{r}`" not in doc)
    assert not missing, f"add these reasons to docs/troubleshooting.md: {missing}"
