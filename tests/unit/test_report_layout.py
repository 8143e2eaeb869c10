"""refit_operator.tools.report lays a failed refit out without overlaps: the timeline's phase
labels stay inside the timeline, its step legend within the timeline's height, and the status
message below both (the demo's three-pod rejection drew its failure label and message over the
step legend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from refit_operator.tools.report import figure, render

STEPS = {"stage": 0.06, "drain": 0.24, "sleep": 0.08, "wakeWeights": 0.12, "load": 2.4,
         "wakeKV": 0.14, "resetCache": 0.01, "stampVersion": 0.02, "probe": 0.5}  # fmt: skip
MESSAGE = (
    "rolling back: canary rollout-0 failed its probe (LogprobDrift: max |Δlogprob| 3.1 > 0.5 "
    "on prompt 2); 1 pods rolled back to v2 (rollout-0); 2 pods kept what they served "
    "(rollout-1, rollout-2)"
)


def _rejected_canary() -> dict[str, Any]:
    """A three-pod Rolling refit whose canary failed its probe, as the demo's v3 ends."""
    canary = {
        "name": "rollout-0", "phase": "Failed", "step": "probe", "reason": "LogprobDrift",
        "message": "max |Δlogprob| 3.1 > 0.5 on prompt 2", "version": "v3",
        "startTime": "2026-11-29T08:00:01Z", "completionTime": "2026-11-29T08:00:06Z",
        "stepSeconds": STEPS, "outOfTrafficSeconds": 4.0,
        "probe": {"verdict": "Fail", "nll": 2.9, "referenceNll": 2.31,
                  "meanAbsLogprobDiff": 0.4, "maxAbsLogprobDiff": 3.1, "tokens": 96},
    }  # fmt: skip
    pending = [{"name": f"rollout-{i}", "phase": "Pending", "version": "v2"} for i in (1, 2)]
    return {
        "phase": "RolledBack", "message": MESSAGE, "targetPods": 3, "updatedPods": 0,
        "failedPods": 1, "fleet": "app=demo-rollout", "startTime": "2026-11-29T08:00:00Z",
        "pods": [canary, *pending],
    }  # fmt: skip


def _boxes(fig: Any) -> dict[str, Any]:
    fig.canvas.draw()
    timeline = fig.axes[-1]
    labels = [t for t in timeline.texts if t.get_text().startswith(("Failed", "Pending"))]
    assert len(labels) == 3, [t.get_text() for t in timeline.texts]
    return {
        "figure": fig.bbox,
        "timeline": timeline.get_window_extent(),
        "legends": [ax.get_legend().get_window_extent() for ax in fig.axes if ax.get_legend()],
        "labels": [t.get_window_extent() for t in labels],
        "message": fig._supxlabel.get_window_extent(),
    }


@pytest.mark.parametrize("reason", ["LogprobDrift", "CheckpointChecksumMismatchOnReadBack"])
def test_a_failed_refits_labels_and_message_clear_the_legends(reason: str) -> None:
    import matplotlib.pyplot as plt

    status = _rejected_canary()
    status["pods"][0]["reason"] = reason  # a long reason makes a long label
    fig = figure(status, title="demo-v3 → v3: the probe rejects the checkpoint")
    try:
        b = _boxes(fig)
    finally:
        plt.close(fig)
    assert len(b["legends"]) == 2  # probe verdict, step
    for label in b["labels"]:
        assert label.x1 <= b["timeline"].x1, "a phase label runs out of the timeline"
        assert not any(label.overlaps(legend) for legend in b["legends"])
    assert not any(b["message"].overlaps(legend) for legend in b["legends"])
    assert not any(b["message"].overlaps(label) for label in b["labels"])
    # Everything drawn lies inside the picture: the step legend is not cut off at the bottom.
    for box in [*b["legends"], b["message"], *b["labels"]]:
        assert box.y0 >= b["figure"].y0 - 1 and box.x1 <= b["figure"].x1 + 1, box
    assert b["message"].y1 <= min(legend.y0 for legend in b["legends"])
    # The step legend takes columns rather than run below a three-pod timeline.
    assert b["legends"][-1].height <= b["timeline"].height + 1


def test_the_report_of_a_failed_refit_is_written(tmp_path: Path) -> None:
    out = render(_rejected_canary(), tmp_path / "v3.png", title="demo-v3 → v3")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_refit_that_failed_before_any_step_draws_no_empty_legend() -> None:
    import matplotlib.pyplot as plt

    status = _rejected_canary()
    status.update(phase="Failed", message="pod rollout-0: scoring failed: no answer in time")
    status["pods"] = [{"name": f"rollout-{i}", "phase": "Pending"} for i in range(3)]
    fig = figure(status)
    try:
        assert fig.axes[-1].get_legend() is None
    finally:
        plt.close(fig)
