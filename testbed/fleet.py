"""Pod objects of one namespace pointing at simulated (or real) workers, WeightRefits applied
and waited for, and the invariant the operator's cluster tests check all along: a pod's
weights-ready condition is True only with a passed probe at the version its progress records
(a watcher thread polls the pods; `Fleet.close()` checks once more; `violations` lists what
it saw). Also the checks of one driver per pod on a simulated pod's call log."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from refit_client.refit_document import build_refit
from refit_operator.core.api_spec import LEADER_INDEX, LWS_GROUP_LABEL, LWS_INDEX_LABEL
from refit_operator.core.podflow import ADAPTER_PROGRESS_PREFIX, PROGRESS_ANNOTATION
from refit_worker.contract import READINESS_GATE

from testbed.controlplane import ControlPlane
from testbed.operator_process import Operators
from testbed.pods import register_pod
from testbed.simworker import make_sim_checkpoint
from testbed.simworker.fleet import SimPod

if TYPE_CHECKING:
    from testbed.vllm_server import VllmServer

LABELS = {"app": "rollout"}
ENDED = {"Succeeded", "Failed", "Halted", "RolledBack"}
ADMIN_SECRET = "vllm-admin"  # the Secret add_server_pods makes, named by refit_server_pods


class Fleet:
    """Pod objects of one namespace, each pointing at a simulated worker."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp, self.ns = cp, namespace
        self.api = k8s_config.new_client_from_config(str(cp.kubeconfig))
        # Typed as Any: plain dict bodies and _preload_content=False answers.
        self.core: Any = k8s.CoreV1Api(self.api)
        self.custom: Any = k8s.CustomObjectsApi(self.api)
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

    def add_server_pods(
        self, names: Sequence[str], servers: Sequence[VllmServer], secret: str = ADMIN_SECRET
    ) -> None:
        """Real vLLM servers (testbed.vllm_server.start_vllm_pods) as pods of this namespace,
        at their loopback addresses, and the Secret with their admin token that refits name
        (``fleet.adminTokenSecretRef``)."""
        token = base64.b64encode(servers[0].admin_token.encode()).decode()
        self.core.create_namespaced_secret(
            self.ns, {"metadata": {"name": secret}, "data": {"token": token}}
        )
        for name, server in zip(names, servers, strict=True):
            register_pod(self.core, self.ns, name, server.host, labels=LABELS,
                         image="vllm/vllm-openai:test", gate=True)  # fmt: skip

    def serving(
        self, names: Sequence[str], servers: Sequence[VllmServer]
    ) -> dict[str, tuple[str, bool]]:
        """Each server pod's weight version as vLLM reports it, and whether it is in traffic."""
        out = {}
        for name, server in zip(names, servers, strict=True):
            got = httpx.get(server.base_url + "/weight_info", headers=server.admin_headers())
            out[name] = (got.json()["weight_version"], bool(self.ready(self.pod(name))))
        return out

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
            if c["type"] == READINESS_GATE:
                return bool(c["status"] == "True")
        return None

    @staticmethod
    def progress(pod: dict[str, Any]) -> dict[str, Any] | None:
        text = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
        return json.loads(text) if text else None

    @staticmethod
    def adapter_progress(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The records of the adapters' passes, by adapter name (spec.adapter)."""
        notes = pod["metadata"].get("annotations") or {}
        return {
            key.removeprefix(ADAPTER_PROGRESS_PREFIX): json.loads(text)
            for key, text in notes.items()
            if key.startswith(ADAPTER_PROGRESS_PREFIX) and text
        }

    # ------------------------------------------------------------------- refits
    def apply_refit(
        self, name: str, version: str, path: Path | str, port: int, *,
        adapter: str | None = None, **spec: Any,
    ) -> None:  # fmt: skip
        """A WeightRefit of the LABELS pods; ``spec``: further spec fields as the API spells
        them (refit_document.build_refit's spec_fields); ``adapter``: the LoRA adapter's name
        (``path`` its directory: spec.adapter)."""
        body = build_refit(name, str(path), version, fleet_selector=LABELS, port=port,
                           adapter=adapter, spec_fields=spec)  # fmt: skip
        self.custom.create_namespaced_custom_object(
            "refit.rollout.dev", "v1alpha1", self.ns, "weightrefits", body
        )

    def refit_server_pods(
        self, op: Operators, name: str, version: str, path: Path | str, port: int, *,
        timeout: float = 240.0, **spec: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """A refit of real server pods (add_server_pods) naming their admin Secret, at sleep
        level 1 unless ``spec["sequence"]`` says otherwise, waited for until it ended: its
        status."""
        sequence = {"sleepLevel": 1, **spec.pop("sequence", {})}
        admin = {"adminTokenSecretRef": {"name": ADMIN_SECRET}}
        self.apply_refit(name, version, path, port, fleet=admin, sequence=sequence, **spec)
        return dict(self.wait_phase(name, ENDED, timeout, op)["status"])

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
        op: Operators | None = None,
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
                    self._check(pod, pods)
                out = sum(self.ready(p) is False for p in pods)
                self.max_out_of_traffic = max(self.max_out_of_traffic, out)
                # Listing a large fleet five times a second would load the shared machine.
                interval = 0.2 if len(pods) < 50 else 2.0
            except Exception:  # the API server may be busy; the next poll checks again
                interval = 0.2
            self._stop.wait(interval)

    def _check(self, pod: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        problem = ready_violation(pod, group_leader(pod, pods))
        if problem is not None:
            self.violations.append(problem)

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=5)
        pods = self.pods()
        for pod in pods:
            self._check(pod, pods)
        self.api.close()


def group_leader(pod: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The leader of the pod group (LeaderWorkerSet's labels; spec.fleet.groups) that ``pod``
    follows, among ``pods`` (one listing); None for a pod that follows no leader there."""
    labels = pod["metadata"].get("labels") or {}
    key, index = labels.get(LWS_GROUP_LABEL), labels.get(LWS_INDEX_LABEL)
    if key is None or index in (None, LEADER_INDEX):
        return None
    return next(
        (p for p in pods if (p["metadata"].get("labels") or {}).get(LWS_GROUP_LABEL) == key
         and p["metadata"]["labels"].get(LWS_INDEX_LABEL) == LEADER_INDEX),
        None,
    )  # fmt: skip


def ready_violation(pod: dict[str, Any], leader: dict[str, Any] | None = None) -> str | None:
    """Why a Ready pod may be serving weights no probe passed on (None: it is not). Ready is
    right when the pod's record is a pass that Succeeded with a passed probe; or a pass that
    keeps it serving (staging, refused while staging) under the condition that pass left
    untouched, the one the passed probe of the version it serves wrote, or the one an
    earlier pass wrote when it restored the pod to that version; or a pass that restored it
    to that version with the model untouched. A follower of a pod group (``leader``: its
    group's leader, which carries the group's record) is right only while its leader is."""
    if not Fleet.ready(pod):
        return None
    if leader is not None:
        if not Fleet.ready(leader):
            return f"{pod['metadata']['name']} Ready while its group's leader is not"
        return ready_violation(leader)
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == READINESS_GATE)
    for name, record in Fleet.adapter_progress(pod).items():
        if not _adapter_serves(record):
            return f"{pod['metadata']['name']} Ready while adapter {name} is unprobed: {record}"
    p = Fleet.progress(pod) or {}
    verdict = (p.get("probe") or {}).get("verdict")
    if p.get("outcome") == "Succeeded" and verdict == "Pass":
        return None
    if not p and Fleet.adapter_progress(pod):
        return None  # in traffic by an adapter's probe, which scored the base weights too
    served = p.get("serving")
    staging = bool(served) and not p.get("left_traffic") and not p.get("restored")
    message = str(cond.get("message") or "")
    probed = f"weights {served} probed"  # then, after "; ", what its drain kept in flight
    if staging and cond.get("reason") == "ProbePassed" and message.split(";")[0] == probed:
        return None
    # An adapter pass's probe scored the base weights too (through the adapter), and a base
    # pass that stages has not touched them since.
    if staging and cond.get("reason") == "ProbePassed" and message.startswith("adapter "):
        return None
    # Staging under the condition an earlier pass's restore wrote (podflow.readiness): that
    # pass put the pod back on ``served`` with its model untouched, or it would not say so.
    again = (f"serving {served} again: ", f"serving adapter {served} again: ")
    restored_to = cond.get("reason") in ("PreviousWeights", "PreviousAdapter")
    if staging and restored_to and message.startswith(again):
        return None
    # Restored only while no try of the pass may have changed the model (podflow.touched).
    if p.get("restored") and not p.get("touched") and cond.get("reason") == "PreviousWeights":
        return None
    return f"{pod['metadata']['name']} Ready without a passed probe: {cond} {p}"


def _adapter_serves(p: dict[str, Any]) -> bool:
    """An adapter's record lets its pod be Ready: its pass Succeeded with a passed probe, or
    it has not swapped yet (the old adapter, probed, serves on), or it restored the old one
    with the served adapter never touched."""
    if p.get("outcome") == "Succeeded":
        return (p.get("probe") or {}).get("verdict") == "Pass"
    return not p.get("left_traffic") and (not p.get("outcome") or bool(p.get("restored")))


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


@contextlib.contextmanager
def serving_fleet(
    cp: ControlPlane, servers: Sequence[VllmServer], names: Sequence[str], version: str,
    path: Path | str, *, namespace: str, log_dir: Path, replicas: int = 1,
    timeout: float = 240.0,
) -> Iterator[tuple[Fleet, Operators]]:  # fmt: skip
    """Real server pods (testbed.vllm_server.start_vllm_pods) in a namespace of their own,
    under ``replicas`` operator processes, serving ``version`` after an idle refit from
    ``path``; at the end the operators stop and the fleet's invariant must have held."""
    ns = cp.create_namespace(namespace)
    op, fl = Operators(cp.kubeconfig, ns, log_dir), Fleet(cp, ns)
    try:
        fl.add_server_pods(names, servers)
        for _ in range(replicas):
            op.start()
        st = fl.refit_server_pods(op, f"to-{version.lower()}", version, path, servers[0].port,
                                  timeout=timeout)  # fmt: skip
        assert st["phase"] == "Succeeded", (st, op.logs())
        yield fl, op
    finally:
        op.stop_all()
        fl.close()
    assert not fl.violations, "\n".join(fl.violations)
