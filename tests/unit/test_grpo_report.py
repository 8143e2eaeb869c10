"""refit_client.grpo_report.render_grpo: reward and refit time per step of a GRPO run, from the
run document testbed/grpo_trainer.py writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import pytest
from refit_client.grpo_report import render_grpo


def _run(steps: int) -> dict[str, Any]:
    """A run of `steps` steps as the trainer writes it: steps+1 publishes (the last one the
    final weights, without rollouts), the reward TRL logged per step, JSON's string keys."""
    records = [
        {"step": s, "version": f"grpo-step-{s}", "refit": f"grpo-step-{s}",
         "publish_seconds": 0.2, "operator_seconds": 4.0 + s,
         "generation_seconds": 1.5 if s < steps else 0.0,
         "pods": {"vllm-0": 8, "vllm-1": 8} if s < steps else {},
         "max_abs_logprob_diff": 1e-5 if s < steps else None}
        for s in range(steps + 1)
    ]  # fmt: skip
    scored = {str(s): {"reward": 0.1 * s, "loss": 0.0, "versions": [f"grpo-step-{s}"]}
              for s in range(steps)}  # fmt: skip
    return {"records": records, "steps": scored, "end": {"phase": "Succeeded"}}


def test_draws_reward_and_refit_time_per_step(tmp_path: Path) -> None:
    run = json.loads(json.dumps(_run(3)))  # as read back from the trainer's file
    out = render_grpo(run, tmp_path / "grpo.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = mpimg.imread(out).shape[:2]
    assert width >= 800 and height >= 600


def test_a_run_that_stopped_before_any_reward_still_draws(tmp_path: Path) -> None:
    run = _run(0)  # only step 0 was published, then training stopped
    run["end"] = {"phase": "Halted"}
    assert render_grpo(run, tmp_path / "halted.png").stat().st_size > 0


def test_a_run_without_steps_is_a_clear_error(tmp_path: Path) -> None:
    for empty in ({}, {"records": [], "steps": {}, "end": {"phase": ""}}):
        with pytest.raises(ValueError, match="no steps"):
            render_grpo(empty, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
