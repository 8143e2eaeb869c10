"""monitoring/dashboards: generated from refit_operator.dashboards, committed, well-formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from grafana_foundation_sdk.models.dashboard import Dashboard
from refit_operator import dashboards

from tests.observability import artifacts

REGENERATE = "python -m refit_operator.dashboards --out monitoring/dashboards"


def test_committed_json_is_up_to_date() -> None:
    expected = dashboards.rendered()
    committed = {p.name: p.read_text() for p in artifacts.DASHBOARD_DIR.glob("*.json")}
    assert set(committed) == set(expected), f"run: {REGENERATE}"
    for name, text in expected.items():
        assert committed[name] == text, f"monitoring/dashboards/{name} is stale; run: {REGENERATE}"


def test_check_mode_detects_a_stale_file(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "refit_operator.dashboards", "--out", str(tmp_path)]
    assert subprocess.run([*cmd, "--check"], capture_output=True).returncode == 1
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert subprocess.run([*cmd, "--check"], capture_output=True).returncode == 0
    (tmp_path / "reload-health.json").write_text("{}")
    proc = subprocess.run([*cmd, "--check"], capture_output=True, text=True)
    assert proc.returncode == 1 and "out of date" in proc.stderr


def test_dashboards_parse_back_with_the_sdk() -> None:
    for name, board in artifacts.dashboards().items():
        parsed = Dashboard.from_json(board)
        assert parsed.title and parsed.uid, name
        assert len(parsed.panels or []) == len(board["panels"])


def test_template_variables_and_datasource() -> None:
    for name, board in artifacts.dashboards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert set(variables) >= {"datasource", "namespace", "fleet"}, name
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert "$namespace" in variables["fleet"]["query"]
        ids = [p["id"] for p in artifacts.panels(board)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in artifacts.panels(board):
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel.get("description"), f"{name}/{panel['title']}: no description"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"


def test_fleet_queries_filter_on_namespace_and_fleet() -> None:
    operator_wide = ("refit_operator_", "up{")
    queries = artifacts.panel_queries()
    assert len(queries) >= 20
    for q in queries:
        if any(m in q.expr for m in operator_wide):
            continue
        assert 'namespace=~"$namespace"' in q.expr and 'fleet=~"$fleet"' in q.expr, q


def test_panels_cover_the_issue() -> None:
    titles = {p["title"] for b in artifacts.dashboards().values() for p in artifacts.panels(b)}
    for needed in (
        "|Δlogprob| mean per pod",
        "|Δlogprob| max per pod",
        "Probe NLL per pod",
        "Probe verdicts",
        "Step duration p50",
        "Step duration p95",
        "Refit outcomes",
        "Version skew",
        "Pods out of traffic",
        "Operator up",
    ):
        assert needed in titles
    # Probe panels draw the refit's threshold as a second, dashed series.
    board = artifacts.dashboards()["reload-health.json"]
    for panel in artifacts.panels(board):
        if panel["title"].startswith("|"):
            exprs = [t["expr"] for t in panel["targets"]]
            assert any("refit_probe_threshold_" in e for e in exprs), panel["title"]
            props = json.dumps(panel["fieldConfig"]["overrides"])
            assert "custom.lineStyle" in props
