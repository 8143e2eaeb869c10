"""TRL's asynchronous GRPO trains through Refit, on real parts: a trainer process
(`testbed.async_grpo_trainer`: TRL's ``AsyncGRPOTrainer`` on the tiny model in fp32, with
``RefitWeightTransfer`` and ``RefitRolloutWorker``) publishes its policy at every optimizer step
as one broadcast WeightRefit (Rolling, one pod at a time, drainMode keep), the `refit-operator`
process on the real API server refits two real vLLM CPU pods to it, and meanwhile the worker
keeps generating on those pods.

What the run must show: every sync's refit Succeeded, the fleet kept finishing completions
during every refit after the first (the worker starts after it), every sample the trainer took
was generated (by the pods' weight-version spans) within max_staleness of the version it
trained from, the drops counted with their reasons, the trainer-vs-fleet logprob mismatch
reported per version, and a reward that rises. On CPU the trainer runs with the two shims
testbed.async_grpo_trainer names (TRL's tree attention kernel and its MFU device query).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.controlplane import ControlPlane
from testbed.fleet import ADMIN_SECRET, Fleet, serving_fleet
from testbed.grpo_trainer import REPO, rollout_pods
from testbed.operator_process import Operators
from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, free_port

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(600)]

PODS = ("vllm-0", "vllm-1")
HOSTS = ("127.0.0.6", "127.0.0.7")
STEPS = 8
MAX_STALENESS = 2


@pytest.fixture(scope="module")
def servers(tiny_model: TinyModel) -> Iterator[list[VllmServer]]:
    with rollout_pods(tiny_model, HOSTS) as servers:
        yield servers


@pytest.fixture(scope="module")
def fleet(
    control_plane: ControlPlane,
    weightrefit_crd: str,
    servers: list[VllmServer],
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Fleet, Operators]]:
    with serving_fleet(
        control_plane, servers, PODS, "A", tiny_model.checkpoints["A"], namespace="async-grpo",
        log_dir=tmp_path_factory.mktemp("async-grpo-logs"), timeout=180,
    ) as fleet:  # fmt: skip
        yield fleet


def run_trainer(fl: Fleet, servers: list[VllmServer], tiny: TinyModel, out: Any) -> dict:
    import subprocess
    import sys

    spec = {"admin_token_secret": ADMIN_SECRET, "sequence": {"sleepLevel": 1}}
    cmd = [
        sys.executable, "-m", "testbed.async_grpo_trainer",
        "--kubeconfig", str(fl.cp.kubeconfig), "--namespace", fl.ns,
        "--fleet-port", str(servers[0].port), "--port", str(free_port("127.0.0.1")),
        "--model-dir", str(tiny.checkpoints["A"]), "--probe-texts", str(tiny.probe_texts_file),
        "--out", str(out), "--steps", str(STEPS), "--max-staleness", str(MAX_STALENESS),
        "--spec", json.dumps(spec),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer exited {done.returncode}: {done.stderr[-4000:]}")
    return dict(json.loads(out.read_text()))


def test_async_grpo_trains_through_rolling_keep_refits(fleet, servers, tiny_model, tmp_path):
    fl, op = fleet
    run = run_trainer(fl, servers, tiny_model, tmp_path / "run.json")
    report = run["consumption"]
    summary = json.dumps({k: run[k] for k in ("end", "steps", "syncs", "consumption")}, indent=1)
    print("\nasync GRPO run:", summary)
    assert run["end"] == {"phase": "Succeeded"}, (summary, op.logs())
    # One sync at train begin and one after each optimizer step, every one Succeeded.
    versions = [f"async-v{n}" for n in range(1, STEPS + 2)]
    assert [s["version"] for s in run["syncs"]] == versions, summary
    assert {s["phase"] for s in run["syncs"]} == {"Succeeded"}, summary
    items = fl.custom.list_namespaced_custom_object(
        "refit.rollout.dev", "v1alpha1", fl.ns, "weightrefits"
    )["items"]
    phases = {r["spec"]["broadcast"]["version"]: r["status"]["phase"]
              for r in items if "broadcast" in r["spec"]}  # fmt: skip
    assert set(phases) == set(versions), phases
    assert set(phases.values()) <= {"Succeeded", "Superseded"}, phases
    # The fleet never stopped generating: completions finished during every refit the
    # worker ran through (it starts once the first sync Succeeded).
    finished = [f[0] for f in run["finished"]]
    during = [sum(s["began"] <= t <= s["ended"] for t in finished) for s in run["syncs"][1:]]
    assert all(n > 0 for n in during), (during, summary)
    # Every sample trained on was generated within the bound, by the pods' spans.
    consumed = report["consumed"]
    assert sum(c["samples"] for c in consumed.values()) >= STEPS * 16, summary
    worst = max(int(k) for c in consumed.values() for k in c["staleness"])
    assert worst <= MAX_STALENESS, summary
    for version, c in consumed.items():
        for served in c["served"]:
            n = int(served.rsplit("-v", 1)[1])
            assert int(version) - MAX_STALENESS <= n <= int(version), (version, c)
    # The mismatch where the trainer held the very version a sample was served at.
    diffs = {v: c["maxAbsLogprobDiff"] for v, c in consumed.items()
             if c["maxAbsLogprobDiff"] is not None}  # fmt: skip
    assert diffs and all(d < 1e-3 for d in diffs.values()), diffs
    assert run["losses_finite"], summary
    rewards = [run["steps"][str(s)]["reward"] for s in range(1, STEPS + 1)]
    print("rewards", rewards, "dropped", report["dropped"], "during refits", during)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
