"""refit_client.report: a PNG of one refit, from a status dict and from the API server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from refit_client.report import VERDICT_COLORS, render

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
    from testbed.controlplane import ControlPlane

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
    cmd = [sys.executable, "-m", "refit_client.report", "--refit", name, "-n", namespace,
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


def _pod_doc(name: str, progress: dict | None) -> dict:
    from refit_operator.core.podflow import PROGRESS_ANNOTATION

    meta: dict = {"name": name}
    if progress is not None:
        meta["annotations"] = {PROGRESS_ANNOTATION: json.dumps(progress)}
    return {"metadata": meta, "spec": {}, "status": {"phase": "Running"}}


def _passed(i: int) -> dict:
    pod = halted_rolling_refit()["pods"][i]
    return {"refit": "wr", "uid": "u1", "version": "v2", "path": "/c", "step": "",
            "outcome": "Succeeded", "started": 1.8e9, "finished": 1.8e9 + 20,
            "step_seconds": pod["stepSeconds"], "probe": pod["probe"]}  # fmt: skip


def test_report_draws_pods_the_status_does_not_list(tmp_path: Path) -> None:
    """A Succeeded refit lists no pods in its status: the report draws every pod of the fleet
    from its own record (the progress annotation)."""
    from refit_client.report import render_refit

    status = halted_rolling_refit()
    status.update(phase="Succeeded", failedPods=0, inconclusivePods=0, pods=[], message="")
    doc = {"metadata": {"name": "wr", "namespace": "ns", "uid": "u1"}, "status": status,
           "spec": {"checkpoint": {"version": "v2"}}}  # fmt: skip
    with pytest.raises(ValueError, match="lists no pods"):
        render_refit(doc, tmp_path / "none.png")
    pods = [_pod_doc(f"vllm-{i}", _passed(i)) for i in range(3)] + [_pod_doc("new", None)]
    png = mpimg.imread(render_refit(doc, tmp_path / "all.png", pods))
    assert _has_color(png, VERDICT_COLORS["Pass"], 1000)
    assert not _has_color(png, VERDICT_COLORS["Fail"], 5000)


def test_a_large_fleet_is_drawn_whole_at_a_fixed_size(tmp_path: Path) -> None:
    from refit_client.report import LABELLED_ROWS
    from refit_operator.core import api_status

    status = halted_rolling_refit()
    results = [
        api_status.PodResult.model_validate({**p, "name": f"vllm-{i:05d}-{p['name']}"})
        for i in range(LABELLED_ROWS) for p in status["pods"]
    ]  # fmt: skip
    png = mpimg.imread(render(status, tmp_path / "large.png", pods=results))
    assert png.shape[0] < 6000  # not one 0.28 in row per pod
    assert _has_color(png, VERDICT_COLORS["Fail"], 1000)
    assert _has_color(png, VERDICT_COLORS["Pass"], 1000)


def test_the_timeline_shades_each_pods_time_out_of_traffic(tmp_path: Path) -> None:
    """render_refit reads each pod's window out of traffic from its record (left_traffic to
    finished) and shades it behind the steps; without windows nothing is shaded."""
    from refit_client.report import OUT_OF_TRAFFIC_COLOR, render_refit
    from refit_operator.core.times import epoch

    status = halted_rolling_refit()
    for p in status["pods"]:
        p.pop("outOfTrafficSeconds", None)
    status.update(phase="Succeeded", failedPods=0, inconclusivePods=0, pods=[], message="")
    status.pop("outOfTraffic")
    doc = {"metadata": {"name": "wr", "namespace": "ns", "uid": "u1"}, "status": status,
           "spec": {"checkpoint": {"version": "v2"}}}  # fmt: skip
    t0 = epoch(status["startTime"])
    assert t0 is not None

    def record(i: int, *, out: bool) -> dict:
        rec = {**_passed(i), "started": t0 + 1, "finished": t0 + 40}
        return {**rec, "left_traffic": t0 + 5} if out else rec

    shaded = [_pod_doc(f"vllm-{i}", record(i, out=True)) for i in range(3)]
    png = mpimg.imread(render_refit(doc, tmp_path / "shaded.png", shaded))
    assert _has_color(png, OUT_OF_TRAFFIC_COLOR, 2000)
    plain = [_pod_doc(f"vllm-{i}", record(i, out=False)) for i in range(3)]
    png = mpimg.imread(render_refit(doc, tmp_path / "plain.png", plain))
    assert not _has_color(png, OUT_OF_TRAFFIC_COLOR, 200)


def test_windows_from_records_and_from_results() -> None:
    from refit_client.report import record_windows, result_windows
    from refit_operator.core import api_status
    from refit_operator.core.podflow import Progress

    done = Progress(refit="wr", uid="u1", version="v2", path="/c", outcome="Succeeded",
                    step="", left_traffic=105.0, finished=117.5)  # fmt: skip
    in_flight = Progress(refit="wr", uid="u1", version="v2", path="/c", step="load",
                         left_traffic=106.0)  # fmt: skip
    left_out = Progress(refit="wr", uid="u1", version="v2", path="/c", outcome="Failed",
                        step="probe", left_traffic=107.0, finished=130.0)  # fmt: skip
    staging = Progress(refit="wr", uid="u1", version="v2", path="/c", serving="v1")
    got = record_windows({"a": done, "b": in_flight, "c": left_out, "d": staging})
    assert got == {"a": (105.0, 117.5), "b": (106.0, None), "c": (107.0, None)}

    results = [
        api_status.PodResult(
            name="a", completion_time="2026-11-29T08:00:20Z", out_of_traffic_seconds=12
        ),
        api_status.PodResult(
            name="b", completion_time="2026-11-29T08:00:20Z"
        ),  # left out: no figure
        api_status.PodResult(name="c", out_of_traffic_seconds=3.0),  # no completion time: no window
    ]
    end = 1795939220.0  # 2026-11-29T08:00:20Z
    assert result_windows(results) == {"a": (end - 12, end)}


def test_the_title_headlines_worst_and_median_time_out_of_traffic() -> None:
    from refit_client.report import headline
    from refit_operator.core import api_status

    st = api_status.WeightRefitStatus.model_validate(halted_rolling_refit())
    assert headline(st, {}) == (
        "time out of traffic: worst 19.7s (vllm-rollout-2), median 18.5s over 3 pod(s) put back"
    )
    # The windows drawn measure more pods than the status (an operator older than the field):
    # they give the figures; pods still out are counted.
    empty = api_status.WeightRefitStatus()
    windows = {"a": (100.0, 400.0), "b": (100.0, 110.0), "c": (100.0, None)}
    assert headline(empty, windows) == (
        "time out of traffic: worst 5m0s (a), median 2m35s over 2 pod(s) put back, 1 still out"
    )
    assert headline(empty, {"c": (100.0, None)}) == (
        "time out of traffic: no pod put back yet, 1 still out"
    )
