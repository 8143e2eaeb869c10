"""Every generated or copied file (the CRD from the models of core/api.py, API reference,
dashboards, the chart's copies of the CRDs, the dashboards and the alert rules) is what
`make generate` (hack/generate.py) makes of its source: a stale one fails here, by name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hack import gen_crd, generate

REPO = Path(__file__).resolve().parents[2]
CHART = generate.CHART


def test_every_generated_file_is_current() -> None:
    found = generate.stale(REPO)
    assert not found, f"stale: {', '.join(found)}; run: {generate.COMMAND}"


def test_the_generated_files_are_these() -> None:
    assert set(generate.expected(REPO)) == {
        "crds/weightrefit.yaml",
        "docs/api-reference.md",
        "monitoring/dashboards/reload-health.json",
        f"{CHART}/files/dashboards/reload-health.json",
        f"{CHART}/crds/weightrefit.yaml",
        f"{CHART}/files/alerts.yaml",
    }


def test_generate_fixes_what_check_names(tmp_path: Path) -> None:
    """From the sources alone (the CRD from the models), generate writes everything; then a
    changed copy, a stale dashboard and a file no source makes are each named, and generate
    puts them right."""
    (tmp_path / "monitoring").mkdir()
    shutil.copy(REPO / "monitoring" / "alerts.yaml", tmp_path / "monitoring" / "alerts.yaml")
    made = set(generate.expected(tmp_path))
    assert set(generate.stale(tmp_path)) == made  # nothing generated yet
    assert set(generate.generate(tmp_path)) == made
    assert generate.stale(tmp_path) == []
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes(), rel

    (tmp_path / "monitoring" / "alerts.yaml").write_text("groups: []\n")
    (tmp_path / "monitoring" / "dashboards" / "reload-health.json").write_text("{}")
    (tmp_path / CHART / "crds" / "removed.yaml").write_text("kind: Old\n")
    names = [
        f"{CHART}/crds/removed.yaml",
        f"{CHART}/files/alerts.yaml",
        "monitoring/dashboards/reload-health.json",
    ]
    assert generate.stale(tmp_path) == names
    cmd = [sys.executable, "-m", "hack.generate", "--root", str(tmp_path)]
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 1
    assert check.stderr.strip() == f"stale: {', '.join(names)}; run: make generate"
    assert subprocess.run(cmd, capture_output=True, cwd=REPO).returncode == 0
    assert generate.stale(tmp_path) == []
    assert not (tmp_path / CHART / "crds" / "removed.yaml").exists()
    assert (tmp_path / CHART / "files" / "alerts.yaml").read_text() == "groups: []\n"


def test_the_committed_crd_is_what_the_models_make() -> None:
    """crds/weightrefit.yaml is generated from core/api.py: an edit to either alone fails here
    (edit the models, then `make generate`)."""
    committed = (REPO / generate.CRD).read_text()
    assert committed == gen_crd.render(), f"stale: {generate.CRD}; run: {generate.COMMAND}"
    assert (REPO / CHART / generate.CRD).read_text() == committed
