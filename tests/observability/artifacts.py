"""Read the monitoring artifacts (dashboards, alert rules) and the PromQL they hold."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "monitoring" / "dashboards"
ALERTS = ROOT / "monitoring" / "alerts.yaml"
RULE_TESTS = ROOT / "monitoring" / "tests"
METRICS_DOC = ROOT / "docs" / "metrics.md"
RUNBOOK = ROOT / "docs" / "runbook.md"

# Metric names in PromQL: every metric of ours starts with refit_; Prometheus' own `up` is the
# only other one used. Label values such as job=~".*refit-operator.*" never match (hyphen).
_METRIC = re.compile(r"\b(refit_[a-z0-9_]+|up)\b(?=\s*[{\[)\s,]|$)")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|count|sum)$")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str
    instant: bool


@dataclass(frozen=True)
class AlertRule:
    group: str
    alert: str
    expr: str
    for_: str
    labels: dict[str, str]
    annotations: dict[str, str]


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def family(sample_name: str) -> str:
    """refit_step_duration_seconds_bucket -> refit_step_duration_seconds."""
    return _HISTOGRAM_SUFFIX.sub("", sample_name)


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def panel_queries() -> list[PanelQuery]:
    out = []
    for name, board in dashboards().items():
        for panel in _panels(board.get("panels", [])):
            for target in panel.get("targets", []):
                out.append(
                    PanelQuery(
                        dashboard=name,
                        panel=panel["title"],
                        ref=target["refId"],
                        expr=target["expr"],
                        instant=bool(target.get("instant")),
                    )
                )
    return out


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return list(_panels(board.get("panels", [])))


def variable_queries() -> list[str]:
    return [
        v["query"]
        for board in dashboards().values()
        for v in board.get("templating", {}).get("list", [])
        if v.get("type") == "query"
    ]


def alert_rules() -> list[AlertRule]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [
        AlertRule(
            group=group["name"],
            alert=rule["alert"],
            expr=rule["expr"],
            for_=rule.get("for", ""),
            labels=rule.get("labels", {}),
            annotations=rule.get("annotations", {}),
        )
        for group in doc["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def grafana_substitute(expr: str, *, namespace: str, fleet: str, range_: str) -> str:
    """What Grafana sends for our template variables (the regex of the selected values)."""
    return (
        expr.replace("$namespace", namespace)
        .replace("$fleet", fleet)
        .replace("$__rate_interval", "1m")
        .replace("$__range", range_)
    )
