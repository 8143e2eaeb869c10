"""`kubectl refit` through the real kubectl (plugin discovery on PATH) against the real API
server: plan without touching anything, then status, history and wait around real refits
by the real operator with simulated workers."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.controlplane import ControlPlane
from testbed.fleet import Fleet, make_checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

INSTALLED = Path(sys.executable).with_name("kubectl-refit")


@pytest.fixture
def kubectl_refit(control_plane: ControlPlane, tmp_path: Path):
    """Run `kubectl refit ...` as a user would: kubectl finds kubectl-refit on PATH (the
    installed console script, or a shim running the same module before it is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plugin = bin_dir / "kubectl-refit"
    if INSTALLED.exists():
        plugin.symlink_to(INSTALLED)
    else:
        plugin.write_text(
            f'#!/bin/sh\nexec {sys.executable} -m refit_operator.tools.kubectl_plugin "$@"\n'
        )
        plugin.chmod(0o755)
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip

    def run(
        *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(control_plane.bin / "kubectl"), "refit", *args], env=env,
                              input=input, capture_output=True, text=True, timeout=120)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl refit {args} -> {proc.returncode}\n{proc.stderr}")
        return proc

    return run


@dataclass
class Addr:
    """Where a pod with no worker behind it is: all of a SimPod that Fleet.add_pod reads."""

    ip: str


def all_objects(cp: ControlPlane, ns: str) -> str:
    return cp.kubectl("get", "pods,weightrefits", "-n", ns, "-o", "json").stdout


def test_plan_shows_batches_and_changes_nothing(
    control_plane, weightrefit_crd, namespace, kubectl_refit, tmp_path
):
    fleet = Fleet(control_plane, namespace)
    try:  # Pod objects only: plan reads them and talks to no worker.
        for i in range(4):
            fleet.add_pod(f"pod-{i}", Addr(f"127.3.0.{i + 1}"))  # type: ignore[arg-type]
        fleet.add_pod("nogate", Addr("127.3.0.9"), gate=False, labels={"app": "other"})  # type: ignore[arg-type]
    finally:
        fleet.close()
    manifest = tmp_path / "wr.yaml"
    manifest.write_text("""
apiVersion: refit.rollout.dev/v1alpha1
kind: WeightRefit
metadata: {name: step-2}
spec:
  fleet: {selector: {matchLabels: {app: rollout}}}
  checkpoint: {path: /ckpt/step-2, version: step-2}
  strategy: {type: Rolling, maxUnavailable: 50%, canary: 1}
""")
    before = all_objects(control_plane, namespace)
    out = kubectl_refit("plan", "-n", namespace, "-f", str(manifest)).stdout
    lines = out.splitlines()
    assert "Fleet app=rollout: 4 pods; strategy Rolling, maxUnavailable 50% -> 2 at a time" in out
    batches = [line.split(None, 2) for line in lines if line.startswith("batch")]
    assert [b[2].strip() for b in batches] == [
        "(canary: must pass before the rest)  pod-0", "pod-1, pod-2", "pod-3"]  # fmt: skip
    assert "Preflight would stop" not in out
    assert all_objects(control_plane, namespace) == before  # nothing created or changed

    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest.read_text().replace("/ckpt/step-2", "ckpt/step-2"))
    proc = kubectl_refit("plan", "-n", namespace, "-f", str(bad), check=False)
    assert proc.returncode == 2 and "spec.checkpoint.path" in proc.stderr, proc.stderr

    other = manifest.read_text().replace("app: rollout", "app: other")
    out = kubectl_refit("plan", "-n", namespace, "-f", "-", input=other).stdout
    assert "nogate: no readiness gate" in out and "MissingReadinessGate" in out
    assert all_objects(control_plane, namespace) == before


def test_status_history_wait_around_real_refits(harness, sim_fleet, tmp_path, kubectl_refit):
    fleet, op = harness
    sims = sim_fleet(3, allowed_root=tmp_path)
    ckpt = make_checkpoints(tmp_path, "v1", "v2", drift={"v2": -0.5})
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    op.start()
    ns = fleet.ns
    fleet.apply_refit("wr1", "v1", ckpt["v1"], sims[0].port)
    proc = kubectl_refit("wait", "wr1", "-n", ns, "--timeout", "60s")
    assert "weightrefit/wr1: Succeeded: 3/3 pods at v1" in proc.stdout
    # wr1's status lists no pod (none needs attention); `status` shows each from its record.
    assert fleet.refit("wr1")["status"]["pods"] == []
    out = kubectl_refit("status", "wr1", "-n", ns).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("pod-")}
    assert [rows[f"pod-{i}"][1:5] for i in range(3)] == [["Succeeded", "ready", "v1", "yes"]] * 3
    assert {rows[f"pod-{i}"][6] for i in range(3)} == {"Pass"}

    fleet.apply_refit("wr2", "v2", ckpt["v2"], sims[0].port,
                      strategy={"type": "Rolling", "maxUnavailable": 1, "canary": 1})  # fmt: skip
    proc = kubectl_refit("wait", "wr2", "-n", ns, "--timeout", "60s", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "weightrefit/wr2: Halted: FailureLimitExceeded" in proc.stdout
    assert "pod-0: Failed" in proc.stdout  # the canary failed; nobody else was touched

    out = kubectl_refit("status", "wr2", "-n", ns).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("pod-")}
    assert rows["pod-0"][1:3] == ["Failed", "probe"] and rows["pod-0"][-1] in (
        "NllDrift", "LogprobDrift")  # fmt: skip
    assert rows["pod-0"][6] == "Fail"
    assert rows["pod-1"][1] == "Pending" and rows["pod-1"][4] == "yes"  # still at v1, in traffic

    out = kubectl_refit("status", "-n", ns).stdout
    assert [line.split()[:3] for line in out.splitlines()[1:]] == [
        ["wr1", "v1", "Succeeded"], ["wr2", "v2", "Halted"]]  # fmt: skip

    out = kubectl_refit("history", "-l", "app=rollout", "-n", ns).stdout
    hist = [line.split() for line in out.splitlines()[2:]]
    assert hist[0][:4] == ["*", "wr1", "v1", "Succeeded"]
    assert hist[1][:4] == ["wr2", "v2", "Halted", "FailureLimitExceeded"]
    assert hist[1][5] == "v1"  # refitted from v1
    assert kubectl_refit("history", "wr1", "-n", ns).stdout == out

    proc = kubectl_refit("wait", "wr1", "-n", ns, "--timeout", "5s")
    assert proc.returncode == 0
    proc = kubectl_refit("status", "nope", "-n", ns, check=False)
    assert proc.returncode == 2 and "not found" in proc.stderr
