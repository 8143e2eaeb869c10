"""The chart's RBAC is sufficient: the operator, started with the exact command line the
chart's Deployment renders and authenticated AS the chart's ServiceAccount, completes a refit
of simulated vLLM pods built from the example fleet's pod template."""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from testbed.controlplane import ControlPlane, free_port
from testbed.operator_process import OperatorProcess
from testbed.simworker import make_sim_checkpoint
from testbed.simworker.fleet import SimPod
from tests.chart.chartkit import CHART, FLEET, Helm, fleet_docs, one

pytestmark = pytest.mark.cluster

RELEASE = "refit"
SA = "refit-refit-operator"
CONDITION = "refit.rollout.dev/weights-ready"


def _fleet_pod(name: str) -> dict[str, Any]:
    """A Pod from the example fleet Deployment's template (what a ReplicaSet would create)."""
    deploy = next(d for d in fleet_docs() if d["kind"] == "Deployment")
    template = copy.deepcopy(deploy["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name},
            "spec": template["spec"]}  # fmt: skip


def _start_pod(cp: ControlPlane, namespace: str, name: str, sim: SimPod) -> None:
    """Create the Pod and play kubelet: Running at the simulated worker's address."""
    cp.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(_fleet_pod(name)))
    status = {
        "status": {
            "phase": "Running",
            "podIP": sim.ip,
            "podIPs": [{"ip": sim.ip}],
            # Started (its startupProbe on /health passed) but not ready: the fleet's readiness
            # probe, /refit/ready, waits for a pass to vouch, and the pass only for started.
            "conditions": [{"type": "ContainersReady", "status": "False"}],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "ready": False,
                    "started": True,
                    "restartCount": 0,
                    "image": "refit-worker",
                    "imageID": "",
                }
            ],
        }
    }
    cp.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
               "-p", json.dumps(status))  # fmt: skip


@contextlib.contextmanager
def _operator(
    args: list[str], kubeconfig: Path, log: Path, pod_name: str
) -> Iterator[OperatorProcess]:
    """`refit-operator ARGS` as the Deployment's container would run it (env from the pod)."""
    env = {"KUBECONFIG": str(kubeconfig), "POD_NAME": pod_name, "PYTHONDONTWRITEBYTECODE": "1"}
    op = OperatorProcess(args, log, env=env)
    try:
        yield op
    finally:
        op.stop(grace=5.0)


def _refused(*logs: Path) -> list[str]:
    return [
        line[:300]
        for log in logs
        for line in log.read_text(errors="replace").splitlines()
        if "Forbidden" in line or " 403" in line
    ]


@dataclass
class ChartFleet:
    cp: ControlPlane
    namespace: str
    args: list[str]  # the operator container's args, as the chart renders them
    operator_sa: Path  # kubeconfig of the chart's ServiceAccount
    trainer: Path  # kubeconfig of the ServiceAccount bound to the chart's trainer Role
    sims: list[SimPod]
    root: Path  # REFIT_ALLOWED_ROOT of the simulated pods
    tmp: Path

    def refit(self, version: str, **fleet: Any) -> str:
        """Create the example WeightRefit (as the trainer) for a new sim checkpoint."""
        doc = yaml.safe_load((FLEET / "weightrefit.yaml").read_text())
        doc["metadata"]["name"] = version
        doc["spec"]["fleet"].update(port=self.sims[0].port, **fleet)
        checkpoint = make_sim_checkpoint(self.root / version, version)
        doc["spec"]["checkpoint"] = {"path": str(checkpoint), "version": version}
        self.cp.kubectl("create", "-n", self.namespace, "-f", "-", input=json.dumps(doc),
                        kubeconfig=self.trainer)  # fmt: skip
        return version

    def status(self, name: str) -> dict[str, Any]:
        out = self.cp.kubectl("get", "wr", name, "-n", self.namespace, "-o", "json").stdout
        status: dict[str, Any] = json.loads(out).get("status") or {}
        return status

    def gate(self, pod: str) -> dict[str, Any]:
        out = self.cp.kubectl("get", "pod", pod, "-n", self.namespace, "-o", "json").stdout
        return {c["type"]: c for c in json.loads(out)["status"]["conditions"]}.get(CONDITION, {})

    def wait(self, what: str, check: Callable[[], Any], procs: list[Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for proc, log in procs:
                assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            if result := check():
                return result
            if time.monotonic() > deadline:
                tail = "\n".join(procs[0][1].read_text(errors="replace").splitlines()[-40:])
                raise AssertionError(f"timed out waiting for {what}; operator log tail:\n{tail}")
            time.sleep(0.5)


@pytest.fixture
def chart_fleet(
    control_plane: ControlPlane,
    weightrefit_crd: str,
    helm: Helm,
    namespace: str,
    sim_fleet: Any,
    tmp_path: Path,
) -> ChartFleet:
    """The chart installed with a trainer, the admin-token and API-key Secrets (as in
    examples/fleet/), three simulated pods that require both."""
    cp = control_plane
    values = [
        f"--set=metrics.port={free_port()}",
        "--set=trainers.subjects[0].kind=ServiceAccount",
        "--set=trainers.subjects[0].name=trainer",
    ]
    helm.run("install", RELEASE, str(CHART), f"--namespace={namespace}", *values,
             kubeconfig=cp.kubeconfig)  # fmt: skip
    rendered = helm.template(namespace=namespace, release=RELEASE,
                             sets=tuple(v.removeprefix("--set=") for v in values))  # fmt: skip
    container = one(rendered, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["refit-operator"]

    token, api_key = secrets.token_hex(16), secrets.token_hex(16)
    for name, key, value in (
        ("vllm-admin-token", "token", token),
        ("vllm-api-key", "key", api_key),
        ("db-password", "token", token),
    ):
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                  "stringData": {key: value}}  # fmt: skip
        cp.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(secret))
    root = tmp_path / "checkpoints"
    sims: list[SimPod] = sim_fleet(3, admin_token=token, api_key=api_key, allowed_root=root)
    for i, sim in enumerate(sims):
        _start_pod(cp, namespace, f"rollout-{i}", sim)
    return ChartFleet(
        cp=cp,
        namespace=namespace,
        args=container["args"],
        operator_sa=cp.as_service_account(namespace, SA),
        trainer=cp.as_service_account(namespace, "trainer"),
        sims=sims,
        root=root,
        tmp=tmp_path,
    )


def test_operator_refits_as_the_chart_service_account(chart_fleet: ChartFleet) -> None:
    f = chart_fleet
    log, standby_log = f.tmp / "operator-a.log", f.tmp / "operator-b.log"
    # Two replicas, as with replicaCount: 2: the Lease lets exactly one act.
    with (
        _operator(f.args, f.operator_sa, log, "refit-operator-a") as a,
        # Its own metrics port: both run on this one host (argparse: the last flag wins).
        _operator(
            [*f.args, f"--metrics-port={free_port()}"],
            f.operator_sa,
            standby_log,
            "refit-operator-b",
        ) as b,  # fmt: skip
    ):
        name = f.refit("step-1")

        def succeeded() -> dict[str, Any] | None:
            status = f.status(name)
            if status.get("phase") in ("Failed", "Halted"):
                raise AssertionError(f"refit ended {status['phase']}: {status.get('message')}")
            return status if status.get("phase") == "Succeeded" else None

        status = f.wait("the refit to succeed", succeeded, [(a, log), (b, standby_log)], 180)
        lease_name = next(a for a in f.args if a.startswith("--lease-name=")).split("=", 1)[1]
        lease = json.loads(f.cp.kubectl("get", "lease", lease_name, "-n", f.namespace,
                                        "-o", "json").stdout)  # fmt: skip
        holder = lease["spec"]["holderIdentity"]
        # The chart's liveness/readiness probe path answers on the chart's metrics port.
        port = next(a for a in f.args if a.startswith("--metrics-port=")).split("=", 1)[1]
        probe = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert probe.status_code == 200, probe.text
        logs = {"refit-operator-a": log, "refit-operator-b": standby_log}
        leaders = [n for n, lg in logs.items() if "acquired by" in lg.read_text(errors="replace")]
        assert len(leaders) == 1 and holder.startswith(leaders[0]), (holder, leaders)

    assert status["updatedPods"] == status["targetPods"] == 3
    assert {c["type"]: c for c in status["conditions"]}["Ready"]["status"] == "True"
    for i, sim in enumerate(f.sims):
        assert f.gate(f"rollout-{i}")["status"] == "True"
        assert sim.state()["weight_version"] == "step-1"
    # Sufficient means nothing was refused along the way, not just that the refit got through
    # (kopf, for one, falls back after ~1 min of refused cluster-wide scans; it must not try).
    refused = _refused(log, standby_log)
    assert not refused, "the operator was refused:\n" + "\n".join(refused[:5])


def test_refit_naming_a_secret_outside_the_chart_allowlist_fails_clearly(
    chart_fleet: ChartFleet,
) -> None:
    """A WeightRefit whose adminTokenSecretRef names a Secret the chart does not let the
    operator read (not in adminToken.secretNames) fails with a reason naming it, and touches
    no pod."""
    f = chart_fleet
    log = f.tmp / "operator.log"
    with _operator(f.args, f.operator_sa, log, "refit-operator-a") as proc:
        name = f.refit("step-1", adminTokenSecretRef={"name": "db-password", "key": "token"})

        def ended() -> dict[str, Any] | None:
            status = f.status(name)
            return status if status.get("phase") in ("Failed", "Halted", "Succeeded") else None

        status = f.wait("the refit to fail", ended, [(proc, log)], 60)
    assert status["phase"] == "Failed", status
    assert "db-password" in status["message"], status["message"]
    for i, sim in enumerate(f.sims):
        assert sim.state()["weight_version"] == "default"
        assert sim.calls() in ([], ["health"]), sim.calls()
        assert f.gate(f"rollout-{i}").get("status") != "True"
