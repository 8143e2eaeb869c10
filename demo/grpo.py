"""The demo's last act: a short GRPO run through Refit.

TRL's GRPOTrainer (`testbed.grpo_trainer`, its own process: torch stays out of the demo's)
trains the tiny model from checkpoint A and publishes its policy to the demo's fleet by
broadcast at every step, one WeightRefit per step (`demo-grpo-step-N`), through
`refit_client.integrations.trl.RefitRollout`; each step's rollouts come from the pods.
N steps are N+1 refits: step 0 publishes the starting model, the end the final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_client.grpo_report import render_grpo
from refit_client.kubectl_text import table

from testbed.grpo_trainer import PROGRESS, command

PREFIX = "demo-grpo"  # its versions, demo-grpo-step-N, are none of the scenario's v1..v4
# Starting the trainer (torch, transformers, TRL) takes up to a minute on 2 cores; each step
# a refit of the fleet and 16 short completions, well under a minute even on a shared machine.
START_SECONDS = 180.0
STEP_SECONDS = 120.0


@dataclass
class GrpoRun:
    steps: int
    log: Path  # the trainer's stderr
    returncode: int | None = None
    seconds: float = 0.0
    doc: dict[str, Any] = field(default_factory=dict)  # the trainer's run document

    @property
    def versions(self) -> list[str]:
        """The versions a whole run publishes, in order."""
        return [f"{PREFIX}-step-{s}" for s in range(self.steps + 1)]

    @property
    def last_version(self) -> str:
        return self.versions[-1]

    def generated_at(self, step: int) -> list[str]:
        """The versions the step's completions were generated at (the pods' spans)."""
        scored = (self.doc.get("steps") or {}).get(str(step)) or {}
        return list(scored.get("versions") or [])

    def problems(self) -> list[str]:
        """What is not as it must be: training Succeeded, every refit published in order,
        every step's completions from that step's version."""
        if self.returncode != 0:
            return [f"the trainer exited {self.returncode}; its log: {self.log}"]
        out = []
        end = self.doc.get("end") or {}
        if end.get("phase") != "Succeeded":
            out.append(f"training ended {end}")
        published = [r["version"] for r in self.doc.get("records") or []]
        if published != self.versions:
            out.append(f"published {published}, expected {self.versions}")
        for s, version in enumerate(self.versions[:-1]):
            if self.generated_at(s) != [version]:
                out.append(f"step {s}'s completions came from {self.generated_at(s)}")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()


def progress_line(step: dict[str, Any], steps: int) -> str:
    """One published step, as the trainer reported it."""
    refit = step["publish_seconds"] + step["operator_seconds"]
    reward = "-" if step.get("reward") is None else f"{step['reward']:.3f}"
    # The last publish is the final weights: no rollouts follow it.
    rollouts = (
        f"reward {reward}, {sum(step['pods'].values())} completions in "
        f"{step['generation_seconds']:.1f}s"
        if step["pods"]
        else "the final weights"
    )
    return (
        f"GRPO step {step['step']}/{steps} {step['version']}: refit {step['phase']} in "
        f"{refit:.1f}s (publish {step['publish_seconds']:.1f}s, operator "
        f"{step['operator_seconds']:.1f}s); {rollouts}"
    )


def run_grpo(
    model: Any, kubeconfig: Path, namespace: str, selector: str, fleet_port: int, secret: str,
    steps: int, out_dir: Path, state: Path, say: Callable[[str], None],
) -> GrpoRun:  # fmt: skip
    """Run the trainer against the fleet to its end, saying each step as it is published."""
    run = GrpoRun(steps, state / "grpo-trainer.log")
    doc_path = out_dir / "grpo-run.json"
    doc_path.unlink(missing_ok=True)  # a file from an earlier run is not this run's
    cmd = command(
        kubeconfig, namespace, fleet_port, model, doc_path, "--selector", selector,
        "--steps", str(steps), "--prefix", PREFIX, spec={"admin_token_secret": secret},
    )  # fmt: skip
    began = time.monotonic()
    with run.log.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=log,
            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        # The trainer bounds each refit and request itself; this bounds the whole run.
        watchdog = threading.Timer(START_SECONDS + STEP_SECONDS * (steps + 1), proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    say(progress_line(json.loads(line[len(PROGRESS) :]), steps))
            run.returncode = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:  # the demo is being stopped: so is the trainer
                proc.kill()
                proc.wait()
    run.seconds = time.monotonic() - began
    if doc_path.exists():
        run.doc = json.loads(doc_path.read_text())
    return run


def summary(run: GrpoRun) -> str:
    """One row per published step: its refit, what its rollouts scored and came from."""
    rows = []
    scored = run.doc.get("steps") or {}
    for rec in run.doc.get("records") or []:
        s = int(rec["step"])
        reward = (scored.get(str(s)) or {}).get("reward")
        final = s == run.steps  # the final weights: no rollouts
        generated = ",".join(run.generated_at(s)) or "-"
        rows.append([
            rec["version"], str(s), "Succeeded",  # a record exists only for a Succeeded refit
            f"{rec['publish_seconds']:.1f}s", f"{rec['operator_seconds']:.1f}s",
            "-" if final else f"{rec['generation_seconds']:.1f}s",
            "-" if reward is None else f"{reward:.3f}",
            "-" if final else generated,
            "ok" if final or run.generated_at(s) == [rec["version"]] else "STALE",
        ])  # fmt: skip
    return table(("VERSION", "STEP", "REFIT", "PUBLISH", "OPERATOR", "GENERATION", "REWARD",
                  "COMPLETIONS FROM", "CHECK"), rows)  # fmt: skip


def picture(run: GrpoRun, out: Path) -> Path | None:
    """The run's reward and refit time per step; None when no step was published."""
    if not run.doc.get("records"):
        return None
    return render_grpo(run.doc, out, title=f"The demo's GRPO run ({run.steps} steps)")
