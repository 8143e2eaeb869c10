"""Helpers for the chart tests: the real Helm binary, rendering, and the files the chart copies."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "refit-operator"
ALL_OPTIONS = Path(__file__).with_name("values-all-options.yaml")
FLEET = REPO / "examples" / "fleet"

# Sources of what the chart carries as copies (Helm reads only files inside the chart);
# `make generate` copies them (hack/generate.py).
SOURCE_ALERTS = REPO / "monitoring" / "alerts.yaml"
SOURCE_DASHBOARDS = REPO / "monitoring" / "dashboards"


# The Prometheus Operator kinds the chart can render, and their CRD files.
MONITORING_CRDS = {
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


def prometheus_operator_crds() -> Path:
    """The Prometheus Operator's own CRD files (hack/prometheus-operator-crds.sh)."""
    script = REPO / "hack" / "prometheus-operator-crds.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(proc.stderr.strip() or f"{script.name} failed", pytrace=False)
    return Path(proc.stdout.strip())


def helm_binary() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "helm.sh")], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(proc.stderr.strip() or "hack/helm.sh failed", pytrace=False)
    return Path(proc.stdout.strip())


@dataclass(frozen=True)
class Helm:
    binary: Path

    def run(
        self, *args: str, kubeconfig: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env_args = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
        proc = subprocess.run(
            [str(self.binary), *args, *env_args], capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def template(
        self,
        *values: Path,
        namespace: str = "refit-system",
        release: str = "refit",
        sets: tuple[str, ...] = (),
    ) -> list[dict[str, Any]]:
        """Rendered objects (templates only; CRDs come from crds/ and are checked apart)."""
        args = ["template", release, str(CHART), f"--namespace={namespace}"]
        for v in values:
            args.append(f"--values={v}")
        for s in sets:
            args.append(f"--set={s}")
        out = self.run(*args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def fleet_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(FLEET.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs
