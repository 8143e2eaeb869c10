"""Shared harness of the operator's cluster tests (no tests here): the real `refit-operator`
process against the test API server, Pod objects pointing at simulated workers, and the
invariant every test checks: a pod's weights-ready condition is True only with a passed probe
at the version its progress records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from refit_operator.cluster import CONDITION, PROGRESS_ANNOTATION

from tests.support.controlplane import ControlPlane
from tests.support.pods import register_pod
from tests.support.simworker import SimPod, make_sim_checkpoint

REPO = Path(__file__).resolve().parents[2]
OPERATOR = Path(sys.executable).with_name("refit-operator")
LABELS = {"app": "rollout"}


@dataclass
class OperatorProc:
    cp: ControlPlane
    namespace: str
    log_dir: Path
    lease_seconds: int = 3
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        log = (self.log_dir / f"operator-{n}.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [str(OPERATOR), "--kubeconfig", str(self.cp.kubeconfig), "--namespace",
             self.namespace, "--metrics-port", "0", "--lease-namespace", self.namespace,
             "--lease-seconds", str(self.lease_seconds), "--identity", f"op{n}", *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        """SIGKILL: no chance to clean up, as when a node dies."""
        proc = proc or self.procs[-1]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)  # a frozen one could not stop
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def freeze(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGSTOP: the process stops between any two instructions, as in a long GC pause
        or CPU throttling, and carries on where it was on thaw()."""
        os.kill(proc.pid, signal.SIGSTOP)

    def thaw(self, proc: subprocess.Popen[bytes]) -> None:
        os.kill(proc.pid, signal.SIGCONT)

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-4000:]
            for p in sorted(self.log_dir.glob("operator-*.log"))
        )


class Fleet:
    """Pod objects of one namespace, each pointing at a simulated worker."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.ns = cp, namespace
        self.api = k8s_config.new_client_from_config(str(cp.kubeconfig))
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.violations: list[str] = []
        self.max_out_of_traffic = 0  # most pods seen with weights-ready False at once
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def add_pod(
        self, name: str, sim: SimPod, *, gate: bool = True, labels: dict[str, str] | None = None
    ) -> None:
        register_pod(self.core, self.ns, name, sim.ip, labels=labels or LABELS,
                     image="vllm/vllm-openai:test", gate=gate)  # fmt: skip

    def restart_container(self, name: str) -> None:
        """What the kubelet reports when the container restarted."""
        pod = self.core.read_namespaced_pod_status(name, self.ns)
        count = sum(c.restart_count for c in pod.status.container_statuses or []) + 1
        cs = [{"name": "vllm", "ready": False, "restartCount": count, "image": "x", "imageID": "",
               "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]  # fmt: skip
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": {"containerStatuses": cs}})

    def pods(self) -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(self.ns, _preload_content=False)
        return list(json.loads(resp.data)["items"])

    def pod(self, name: str) -> dict[str, Any]:
        for p in self.pods():
            if p["metadata"]["name"] == name:
                return p
        raise KeyError(name)

    @staticmethod
    def ready(pod: dict[str, Any]) -> bool | None:
        for c in pod.get("status", {}).get("conditions") or []:
            if c["type"] == CONDITION:
                return bool(c["status"] == "True")
        return None

    @staticmethod
    def progress(pod: dict[str, Any]) -> dict[str, Any] | None:
        text = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
        return json.loads(text) if text else None

    # ------------------------------------------------------------------- refits
    def apply_refit(
        self, name: str, version: str, path: Path | str, port: int, **spec: Any
    ) -> None:
        body = {
            "apiVersion": "refit.rollout.dev/v1alpha1",
            "kind": "WeightRefit",
            "metadata": {"name": name},
            "spec": {
                "fleet": {
                    "selector": {"matchLabels": LABELS},
                    "port": port,
                    **spec.pop("fleet", {}),
                },
                "checkpoint": {"path": str(path), "version": version},
                **spec,
            },
        }
        self.custom.create_namespaced_custom_object(
            "refit.rollout.dev", "v1alpha1", self.ns, "weightrefits", body
        )

    def refit(self, name: str) -> dict[str, Any]:
        doc: dict[str, Any] = self.custom.get_namespaced_custom_object(
            "refit.rollout.dev", "v1alpha1", self.ns, "weightrefits", name
        )
        return doc

    def wait_phase(
        self,
        name: str,
        phases: set[str] | str,
        timeout: float = 90.0,
        op: OperatorProc | None = None,
    ) -> dict[str, Any]:
        want = {phases} if isinstance(phases, str) else phases
        deadline = time.monotonic() + timeout
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            doc = self.refit(name)
            if (doc.get("status") or {}).get("phase") in want:
                return doc
            time.sleep(0.3)
        logs = op.logs() if op else ""
        status = json.dumps(doc.get("status"), indent=1)
        raise AssertionError(f"{name} not in {want} after {timeout}s: {status}\n{logs}")

    def wait_for(self, what: Callable[[], bool], timeout: float = 60.0, why: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if what():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {why}")

    def wait_serving(
        self,
        sim: SimPod,
        endpoint: str,
        tags: str | None = None,
        *,
        after: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Until ``sim`` has received a call of ``endpoint`` (made after a call of ``after``,
        when given) and not yet answered it: a step slowed by a delay fault is then in
        progress. The pod's progress record does not say: it is written at the pass's
        checkpoints, not at every step."""

        def serving() -> bool:
            log = sim.call_log()
            steps = [c["step"] for c in log]
            first = steps.index(after) + 1 if after in steps else 0 if after is None else None
            return first is not None and any(
                c["step"] == endpoint
                and c["status"] is None
                and (tags is None or c["params"].get("tags") == tags)
                for c in log[first:]
            )

        self.wait_for(serving, timeout, f"{sim.ip} serving {endpoint}")

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_event(self.ns, _preload_content=False)
        evs = list(json.loads(items.data)["items"])
        return [e for e in evs if reason is None or e["reason"] == reason]

    # ---------------------------------------------------------------- invariant
    def _watch(self) -> None:
        interval = 0.2
        while not self._stop.is_set():
            try:
                pods = self.pods()
                for pod in pods:
                    self._check(pod)
                out = sum(self.ready(p) is False for p in pods)
                self.max_out_of_traffic = max(self.max_out_of_traffic, out)
                # Listing a large fleet five times a second would load the shared machine.
                interval = 0.2 if len(pods) < 50 else 2.0
            except Exception:  # the API server may be busy; the next poll checks again
                interval = 0.2
            self._stop.wait(interval)

    def _check(self, pod: dict[str, Any]) -> None:
        if not self.ready(pod):
            return
        p = self.progress(pod)
        name = pod["metadata"]["name"]
        verdict = ((p or {}).get("probe") or {}).get("verdict")
        if p is None or verdict != "Pass":
            self.violations.append(f"{name} Ready without a passed probe: {p}")

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        for pod in self.pods():
            self._check(pod)
        self.api.close()


def fenced_calls(sim: SimPod) -> list[dict[str, Any]]:
    """The calls of refit passes (those carrying a fencing token), in arrival order."""
    return [c for c in sim.call_log() if isinstance(c.get("fence"), int)]


def assert_one_driver(sim: SimPod, *, refused_ok: bool = False) -> None:
    """The pod was driven by one pass at a time: the admitted calls' fencing tokens never go
    down and each token's calls are one unbroken run (no pass resumed after another began).
    ``refused_ok``: a stale driver may have tried (and been refused); otherwise none did."""
    calls = fenced_calls(sim)
    admitted = [c["fence"] for c in calls if c["status"] != 409]
    assert admitted == sorted(admitted), f"{sim.ip}: fences went down: {admitted}"
    runs = [f for i, f in enumerate(admitted) if i == 0 or admitted[i - 1] != f]
    assert len(runs) == len(set(runs)), f"{sim.ip}: passes interleaved: {runs}"
    refused = [c for c in calls if c["status"] == 409]
    if not refused_ok:
        assert not refused, f"{sim.ip}: stale calls reached the pod: {refused}"


def start_fleet(
    fleet: Fleet, sim_fleet: Callable[..., list[SimPod]], root: Path, n: int, **kw: Any
) -> list[SimPod]:
    sims = sim_fleet(n, allowed_root=root, **kw)
    for i, sim in enumerate(sims):
        fleet.add_pod(f"pod-{i}", sim)
    return sims


def make_checkpoints(
    root: Path, *versions: str, drift: dict[str, float] | None = None
) -> dict[str, Path]:
    return {v: make_sim_checkpoint(root / v, v, drift=(drift or {}).get(v, 0.0)) for v in versions}


@pytest.fixture
def harness(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str, tmp_path: Path
) -> Iterator[tuple[Fleet, OperatorProc]]:
    logs = tmp_path / "logs"
    logs.mkdir()
    op = OperatorProc(control_plane, namespace, logs)
    fleet = Fleet(control_plane, namespace)
    try:
        yield fleet, op
    finally:
        op.stop_all()
        fleet.close()
    assert not fleet.violations, "\n".join(fleet.violations)
