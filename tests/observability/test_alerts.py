"""monitoring/alerts.yaml: valid, complete, documented, and unit-tested with promtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability import artifacts

REQUIRED_ALERTS = {
    "RefitProbeFailing",
    "RefitStuck",
    "RefitVersionSkew",
    "RefitPodsOutOfTraffic",
    "RefitOutOfTrafficSlow",
    "RefitOperatorDown",
    "RefitOperatorNotReconciling",
}
RULE_TEST_FILES = sorted(artifacts.RULE_TESTS.glob("*.yaml"))


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(promtool: Path) -> None:
    proc = _run([str(promtool), "check", "rules", str(artifacts.ALERTS)], artifacts.ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(artifacts.alert_rules())} rules found" in proc.stdout


@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(promtool: Path, test_file: Path) -> None:
    proc = _run([str(promtool), "test", "rules", test_file.name], test_file.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def _rule_tests_with(
    promtool: Path, alerts: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """promtool's rule unit tests run against ``alerts`` (a changed copy of the rules)."""
    assert alerts != artifacts.ALERTS.read_text()
    (tmp_path / "alerts.yaml").write_text(alerts)
    tests = tmp_path / "tests"
    tests.mkdir()
    for f in RULE_TEST_FILES:
        (tests / f.name).write_text(f.read_text())
    return _run([str(promtool), "test", "rules", "reload_health_test.yaml"], tests)


def test_promtool_test_rules_catches_a_broken_rule(promtool: Path, tmp_path: Path) -> None:
    """The unit tests can fail: with RefitProbeFailing's threshold inverted they do."""
    broken = artifacts.ALERTS.read_text().replace(
        '(refit_probe_verdict{result="fail"}) == 1', '(refit_probe_verdict{result="fail"}) == 0'
    )
    proc = _rule_tests_with(promtool, broken, tmp_path)
    assert proc.returncode != 0
    assert "RefitProbeFailing" in proc.stdout + proc.stderr


def test_every_alert_is_complete_and_documented() -> None:
    rules = artifacts.alert_rules()
    names = {r.alert for r in rules}
    assert names >= REQUIRED_ALERTS
    assert len(names) == len(rules), "alert names must be unique"
    anchors = {
        re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
        for h in re.findall(r"^## (.+)$", artifacts.RUNBOOK.read_text(), re.MULTILINE)
    }
    for r in rules:
        assert r.labels.get("severity") in ("critical", "warning", "info"), r.alert
        assert re.fullmatch(r"\d+[smh]", r.for_), f"{r.alert}: needs a `for` duration"
        assert r.annotations.get("summary") and r.annotations.get("description"), r.alert
        url = r.annotations.get("runbook_url", "")
        assert url == f"docs/runbook.md#{r.alert.lower()}", f"{r.alert}: {url}"
        assert r.alert.lower() in anchors, f"docs/runbook.md has no section {r.alert}"


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for f in RULE_TEST_FILES:
        doc = yaml.safe_load(f.read_text())
        assert doc["rule_files"] == ["../alerts.yaml"]
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r.alert for r in artifacts.alert_rules()}
    assert names <= fired, f"never shown firing: {names - fired}"
    assert names <= quiet, f"never shown quiet: {names - quiet}"


def test_rules_file_is_a_plain_rule_groups_document() -> None:
    """The chart embeds `groups` as a PrometheusRule spec: nothing else may be at top level."""
    doc = yaml.safe_load(artifacts.ALERTS.read_text())
    assert set(doc) == {"groups"}
    assert [g["name"] for g in doc["groups"]] == ["refit-reload-health", "refit-operator-health"]


def test_promtool_catches_a_broken_out_of_traffic_threshold(promtool: Path, tmp_path: Path) -> None:
    """The RefitOutOfTrafficSlow unit tests can fail: with its bound raised past the slow
    fleet's p95 (585 s) the firing case does not fire."""
    broken = artifacts.ALERTS.read_text().replace(
        "(rate(refit_pod_out_of_traffic_seconds_bucket[30m]))) > 300",
        "(rate(refit_pod_out_of_traffic_seconds_bucket[30m]))) > 600",
    )
    proc = _rule_tests_with(promtool, broken, tmp_path)
    assert proc.returncode != 0
    assert "RefitOutOfTrafficSlow" in proc.stdout + proc.stderr
