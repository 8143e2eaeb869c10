"""Every reason the operator can report is named in its catalogue (refit_operator.core.reasons) and
explained in docs/troubleshooting.md.

The catalogue holds the worker's rejection codes (contract.REJECTION_CODES) and the timeout
reason of every step the runner runs; no operator module writes a catalogued reason as a bare
literal, and every other CamelCase literal there is a phase, a spec value or an API name. A
new reason without a catalogue entry or a doc entry fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

from refit_operator.core import api_status, sequences
from refit_operator.core.reasons import Reason, step_timeout
from refit_worker import contract

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "troubleshooting.md"
OPERATOR = REPO / "operator" / "refit_operator"
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
# CamelCase literals that are spec values, API names or prefixes, not reasons.
NOT_REASONS = {"AllAtOnce", "LatestWins", "ConfigMap", "DoesNotExist", "NotIn", "WeightRefit",
               "BearerToken", "PodRefit", "ContainersReady"}  # fmt: skip
PHASES = set(get_args(api_status.Phase)) | set(get_args(api_status.PodPhase))


def camel_literals() -> dict[str, set[str]]:
    """Module -> the CamelCase string literals in its source (the catalogue's own left out)."""
    found: dict[str, set[str]] = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        if path.stem == "reasons":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if CAMEL.match(node.value):
                    found.setdefault(path.stem, set()).add(node.value)
    return found


def test_each_name_is_its_value():
    assert [m.name for m in Reason] == [m.value for m in Reason]


def test_the_catalogue_holds_the_worker_codes_and_every_step_timeout():
    assert set(contract.REJECTION_CODES) <= set(Reason)
    # Every step a pass can stand at, an adapter pass's own and the restore included.
    for step in sequences.Step:
        assert step_timeout(step) in Reason


def test_no_reason_is_written_outside_the_catalogue():
    catalogued = set(Reason) - PHASES  # RolledBack is both a reason and a phase
    stray = {m: sorted(v & catalogued) for m, v in camel_literals().items() if v & catalogued}
    assert not stray, f"use refit_operator.core.reasons.Reason for these: {stray}"
    unknown = {
        m: sorted(v - set(Reason) - PHASES - NOT_REASONS)
        for m, v in camel_literals().items()
        if v - set(Reason) - PHASES - NOT_REASONS
    }
    assert not unknown, (
        f"add these reasons to refit_operator.core.reasons (or NOT_REASONS): {unknown}"
    )


def test_every_reason_is_in_the_troubleshooting_doc():
    doc = DOC.read_text()
    missing = sorted(r.value for r in Reason if f"`{r.value}`" not in doc)
    assert not missing, f"add these reasons to docs/troubleshooting.md: {missing}"
