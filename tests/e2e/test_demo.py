"""`make demo` as a test: the whole scenario on real parts (control plane, operator, three
real vLLM CPU pods, Prometheus) and its closing GRPO run, run as the user runs it, judged by
its own checks and by what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
PODS = int(os.environ.get("REFIT_DEMO_PODS", "3"))
GRPO_STEPS = 8  # the demo's default


def test_demo_runs_the_scenario_and_cleans_up(tmp_path):
    out = tmp_path / "reports"
    proc = subprocess.run(
        [sys.executable, "-m", "demo", "--pods", str(PODS), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1100,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    text = proc.stdout
    assert proc.returncode == 0, text[-6000:] + proc.stderr[-3000:]
    refits = ("demo-v", "demo-lora")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(refits)}
    assert "Succeeded" in rows["demo-v1"] and rows["demo-v1"][-1] == "ok"
    assert "Succeeded" in rows["demo-v2"] and rows["demo-v2"][-1] == "ok"
    v3 = rows["demo-v3"]
    assert "RolledBack" in v3 and v3[-1] == "ok"
    assert re.search(r"LogprobDrift|NllDrift", " ".join(v3))
    # The last version came by broadcast from a trainer process, gated by the same probe.
    v4 = rows["demo-v4"]
    assert "(broadcast)" in v4 and "Succeeded" in v4 and v4[-1] == "ok"
    lora = rows["demo-lora-v1"]  # the adapter refit: beside the base weights, no reload
    assert "adapter policy v1" in " ".join(lora) and "Succeeded" in lora and lora[-1] == "ok"
    # Then a short GRPO run through Refit: one refit per step and one for the final weights,
    # in order, each Succeeded, each step's completions generated at that step's version.
    versions = [f"demo-grpo-step-{s}" for s in range(GRPO_STEPS + 1)]
    live = re.findall(r"GRPO step (\d+)/\d+ (\S+): refit (\w+)", text)
    assert live == [(str(s), v, "Succeeded") for s, v in enumerate(versions)], live
    grpo = [line.split() for line in text.splitlines() if line.startswith("demo-grpo-step-")]
    assert [row[0] for row in grpo] == versions, grpo
    assert all(row[2] == "Succeeded" and row[-1] == "ok" for row in grpo), grpo
    assert [row[-2] for row in grpo[:-1]] == versions[:-1], grpo  # COMPLETIONS FROM
    pods = [line.split() for line in text.splitlines() if line.startswith("rollout-")]
    finals = [p for p in pods if len(p) == 4]  # the read-back table: name, address, version, yes
    assert [p[2:] for p in finals[-PODS:]] == [[versions[-1], "yes"]] * PODS
    assert "outcome as expected" in text
    assert sorted(p.name for p in out.glob("*.png")) == [
        "demo-lora-v1.png",
        "demo-v1.png",
        "demo-v2.png",
        "demo-v3-rejected.png",
        "demo-v3.png",
        "demo-v4.png",
        "grpo.png",
    ]
    assert (out / "grpo.png").stat().st_size > 0
    # Everything it started is gone: no server still listens on the pods' addresses.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "--host 127.0.0.11" not in ps
