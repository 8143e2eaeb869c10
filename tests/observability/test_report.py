"""refit_operator.report: a PNG of one refit, from a status dict and from the API server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from refit_operator.report import VERDICT_COLORS, render

from tests.observability.refit_status import halted_rolling_refit

THRESHOLDS = {"meanAbsLogprobDiff": 0.05, "maxAbsLogprobDiff": 0.5, "nllDiff": 0.05}


def _has_color(png: np.ndarray, hex_color: str, min_pixels: int) -> bool:
    rgb = np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    close = np.all(np.abs(png[:, :, :3] - rgb) < 0.02, axis=2)
    return int(close.sum()) >= min_pixels


def test_renders_a_halted_refit(tmp_path: Path) -> None:
    out = render(halted_rolling_refit(), tmp_path / "r.png", thresholds=THRESHOLDS, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = mpimg.imread(out)
    height, width = png.shape[:2]
    assert width >= 1200 and height >= 600
    # The failed pod's bars, the passing pods' bars, and the inconclusive pod are all drawn.
    assert _has_color(png, VERDICT_COLORS["Fail"], 5000)
    assert _has_color(png, VERDICT_COLORS["Pass"], 1000)


def test_a_clean_refit_has_no_red_bars(tmp_path: Path) -> None:
    status = halted_rolling_refit()
    status["pods"] = [p for p in status["pods"] if p["phase"] == "Succeeded"]
    status.update(phase="Succeeded", failedPods=0, message="")
    png = mpimg.imread(render(status, tmp_path / "ok.png", thresholds=THRESHOLDS))
    # Only the thin dashed threshold lines are red now, far fewer pixels than a failed bar.
    assert not _has_color(png, VERDICT_COLORS["Fail"], 5000)
    assert _has_color(png, VERDICT_COLORS["Pass"], 1000)


def test_many_pods_render(tmp_path: Path) -> None:
    status = halted_rolling_refit()
    template = status["pods"][0]
    status["pods"] = [{**template, "name": f"vllm-{i:03d}"} for i in range(64)]
    out = render(status, tmp_path / "many.png")
    assert mpimg.imread(out).shape[0] > 1500  # the timeline grows with the fleet


def test_bad_status_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lists no pods"):
        render({"phase": "Pending", "pods": []}, tmp_path / "x.png")
    bad = halted_rolling_refit()
    bad["pods"][0]["probe"]["verdict"] = "Maybe"
    with pytest.raises(ValueError, match="verdict"):
        render(bad, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.cluster
def test_cli_reads_the_refit_from_the_api_server(
    control_plane: object, weightrefit_crd: str, namespace: str, tmp_path: Path
) -> None:
    from tests.support.controlplane import ControlPlane

    assert isinstance(control_plane, ControlPlane)
    example = Path(__file__).resolve().parents[2] / "examples" / "weightrefit-minimal.yaml"
    control_plane.kubectl("apply", "-n", namespace, "-f", str(example))
    name = control_plane.kubectl(
        "get", "-n", namespace, "-f", str(example), "-o", "jsonpath={.metadata.name}"
    ).stdout
    status = halted_rolling_refit()
    control_plane.kubectl(
        "patch", "weightrefit", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    out = tmp_path / "cli.png"
    cmd = [sys.executable, "-m", "refit_operator.report", "--refit", name, "-n", namespace,
           "--kubeconfig", str(control_plane.kubeconfig), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert _has_color(mpimg.imread(out), VERDICT_COLORS["Fail"], 5000)

    missing = subprocess.run(
        [*cmd[:4], "no-such-refit", *cmd[5:]], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 1
    assert f"cannot read WeightRefit {namespace}/no-such-refit: HTTP 404" in missing.stderr
