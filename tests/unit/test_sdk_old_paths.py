"""The trainer-side SDK's old import paths (refit_operator.tools.*) keep working for one release:
each warns its importer (DeprecationWarning, naming the new path) and hands over the same
objects as refit_client; `python -m` of the old command modules still runs them."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import refit_client
from refit_client import grpo_report, report

REPO = Path(__file__).resolve().parents[2]
OLD = REPO / "operator" / "refit_operator" / "tools"
# Old path -> the module that replaced it (and is now the old path's module).
MOVED = {
    "refit_operator.tools.client": "refit_client.client",
    "refit_operator.tools.refit_document": "refit_client.refit_document",
    "refit_operator.tools.refit_error": "refit_client.refit_error",
    "refit_operator.tools.checkpoint_files": "refit_client.checkpoint_files",
    "refit_operator.tools.kubeconfig": "refit_client.kubeconfig",
    "refit_operator.tools.kubectl_plugin": "refit_client.kubectl_plugin",
    "refit_operator.tools.integrations.trl": "refit_client.integrations.trl",
}


def _fresh_import(old: str) -> object:
    """Import `old` as a first import would (the shim runs and warns again)."""
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)
    return importlib.import_module(old)


def test_every_old_module_is_covered() -> None:
    shims = {
        "refit_operator." + ".".join(p.relative_to(OLD.parent).with_suffix("").parts)
        for p in OLD.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert shims == {*MOVED, "refit_operator.tools.report", "refit_operator.tools.moved"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_is_the_new_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .* import {MOVED[old]}"):
        module = _fresh_import(old)
    assert module is new
    parent, _, child = old.rpartition(".")
    assert getattr(sys.modules[parent], child) is new  # `from refit_operator.tools import x`


def test_the_old_client_path_hands_over_the_same_classes() -> None:
    with pytest.warns(DeprecationWarning):
        old = _fresh_import("refit_operator.tools.client")
    assert old.RefitClient is refit_client.RefitClient  # type: ignore[attr-defined]
    assert old.RefitFailed is refit_client.RefitFailed  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning):
        trl = _fresh_import("refit_operator.tools.integrations.trl")
    from refit_client.integrations.trl import RefitRollout

    assert trl.RefitRollout is RefitRollout  # type: ignore[attr-defined]


def test_the_old_report_path_has_both_pictures() -> None:
    """One old module became two (the refit's picture, the training run's): the old path
    finds either's names, the same objects, private ones included."""
    with pytest.warns(DeprecationWarning, match="import refit_client.report"):
        old = _fresh_import("refit_operator.tools.report")
    assert old.render_refit is report.render_refit  # type: ignore[attr-defined]
    assert old.VERDICT_COLORS is report.VERDICT_COLORS  # type: ignore[attr-defined]
    assert old._fetch is report._fetch  # type: ignore[attr-defined]
    assert old.render_grpo is grpo_report.render_grpo  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = old.no_such_name  # type: ignore[attr-defined]


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    # Python's default warning filters, as a user's script runs: no -W, no pytest.
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_a_script_importing_an_old_path_sees_the_warning_at_its_import() -> None:
    """The warning points at the user's import statement (not the shim, not importlib), so
    Python's default filters show it to a script."""
    proc = _python("-c", "from refit_operator.tools.client import RefitClient\nprint('ok')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "<string>:1: DeprecationWarning: refit_operator.tools.client is deprecated" in (
        proc.stderr
    )
    assert "import refit_client.client instead" in proc.stderr


@pytest.mark.parametrize(
    ("old", "prog"),
    [
        ("refit_operator.tools.kubectl_plugin", "kubectl refit"),
        ("refit_operator.tools.report", "python -m refit_client.report"),
    ],
)
def test_the_old_commands_still_run_and_warn(old: str, prog: str) -> None:
    proc = _python("-m", old, "--help")
    assert proc.returncode == 0, proc.stderr
    assert prog in proc.stdout
    assert f"DeprecationWarning: {old} is deprecated" in proc.stderr
