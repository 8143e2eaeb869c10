"""The product on a real node: kubelet + containerd + runc under kube-controller-manager and
kube-scheduler (testbed/node.py). Helm installs the chart; the operator runs as a pod of the
operator image built from operator/Dockerfile; vLLM CPU pods carry the readiness gate and
are endpoints of a Service only while the operator says their weights are ready.

The tests run in file order and share one namespace: each stage builds on the one before
(install, fleet, refit, container restart, pod replacement, operator restart, uninstall)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from refit_operator.core.podflow import PROGRESS_ANNOTATION
from refit_worker.contract import READINESS_GATE

from testbed.node import NODE_NAME, POD_SUBNET, Node
from testbed.node_images import BUSYBOX_IMAGE
from testbed.node_workloads import (
    ADMIN_SECRET,
    EndpointSliceWatcher,
    fleet_service,
    helm_binary,
    helm_install_args,
    log,
    vllm_deployment,
    weightrefit,
)
from testbed.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.node, pytest.mark.slow]

NS = "refit-node"
RELEASE = "refit"
FLEET = "rollout"
OPERATOR_LEASE = f"{RELEASE}-refit-operator"  # the chart's fullname
REPLICAS = 2
state: dict[str, Any] = {}


def kubectl_json(node: Node, *args: str) -> Any:
    return json.loads(node.cp.kubectl(*args, "-o", "json").stdout)


# Kinds whose objects come and go on their own (records, not state a chart could leave).
CHURN_KINDS = {"Event"}


def inventory(node: Node) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every object of every listable kind that is cluster-scoped
    or in the test's namespace: where a chart installed there could leave something (the
    system namespaces hold the node's and controllers' own heartbeats)."""
    kinds = node.cp.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    items = kubectl_json(node, "get", ",".join(kinds), "-A")["items"]
    return {
        (i["kind"], i["metadata"].get("namespace", ""), i["metadata"]["name"])
        for i in items
        if i["kind"] not in CHURN_KINDS and i["metadata"].get("namespace", NS) == NS
    }


def wait_for(what: Any, timeout: float, why: str, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {why}")


def fleet_pods(node: Node) -> list[dict[str, Any]]:
    items = kubectl_json(node, "get", "pods", "-n", NS, "-l", "app=rollout")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def gate(pod: dict[str, Any]) -> str | None:
    for c in pod.get("status", {}).get("conditions") or []:
        if c["type"] == READINESS_GATE:
            return str(c["status"])
    return None


def progress(pod: dict[str, Any]) -> dict[str, Any]:
    text = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
    return json.loads(text) if text else {}


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


def serving(pod: dict[str, Any], version: str) -> bool:
    p = progress(pod)
    return (
        gate(pod) == "True"
        and p.get("version") == version
        and p.get("outcome") == "Succeeded"
        and (p.get("probe") or {}).get("verdict") == "Pass"
        and p.get("restarts", 0) == restarts(pod)
    )


def after_leading_true(hist: list[tuple[float, bool]]) -> list[bool]:
    """The endpoint's ready states since a moment it was ready, without the first True."""
    states = [r for _, r in hist]
    while states and states[0]:
        states.pop(0)
    return states


def started_since(pod: dict[str, Any]) -> float | None:
    """Epoch seconds since the pod's containers run and passed their startupProbe (None if
    one has not). Not ContainersReady: /refit/ready keeps that False until a pass vouches."""
    statuses = pod["status"].get("containerStatuses") or []
    if not statuses or not all(c.get("started") for c in statuses):
        return None
    return max(
        dt.datetime.fromisoformat(c["state"]["running"]["startedAt"]).timestamp() for c in statuses
    )


def wait_converged(node: Node, name: str, version: str, since: float, timeout: float) -> None:
    """Wait for pod `name` to serve `version` with a passed probe. Fails early, saying why,
    when the operator's pass for it (begun after `since`) gave up and nothing retried it for
    60 s after the container started again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = kubectl_json(node, "get", "pod", name, "-n", NS)
        if serving(pod, version):
            return
        prog, started = progress(pod), started_since(pod)
        if (
            prog.get("outcome") == "Failed"
            and prog.get("started", 0) >= since - 1
            and started is not None
            and time.time() - max(started, prog.get("finished", 0)) > 60
        ):
            raise AssertionError(
                f"{name}: the operator's pass to {version} failed while the container was not "
                f"started yet and was not retried in the 60 s since it is: "
                f"reason {prog.get('reason')}, step {prog.get('step')}, attempts "
                f"{prog.get('attempts')}, message {prog.get('message')!r}; "
                f"containers started since {started:.1f}, pass {prog.get('started'):.1f}-"
                f"{prog.get('finished'):.1f}, gate {gate(pod)}"
            )
        time.sleep(2)
    raise AssertionError(f"{name} not serving {version} after {timeout:.0f}s: {progress(pod)}")


def operator_logs(node: Node) -> str:
    """The operator's log, this container's and the one before (for a failure message)."""
    pods = kubectl_json(
        node, "get", "pods", "-n", NS, "-l", "app.kubernetes.io/name=refit-operator"
    )
    out = []
    for pod in pods["items"]:
        for previous in (["--previous"], []):
            name = pod["metadata"]["name"]
            proc = node.cp.kubectl("logs", "-n", NS, name, *previous, check=False)
            out.append(proc.stdout[-3000:] if proc.returncode == 0 else proc.stderr.strip())
    return "\n".join(out)


def refit_phase(node: Node, name: str) -> str:
    doc = kubectl_json(node, "get", "weightrefit", name, "-n", NS)
    return str((doc.get("status") or {}).get("phase", ""))


def apply_refit(node: Node, name: str, version: str, timeout: float = 600) -> None:
    ckpt = state["model"].checkpoints[version]
    body = weightrefit(name, version, ckpt, sequence={"sleepLevel": 1})
    node.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(body))
    phase = wait_for(
        lambda: (p := refit_phase(node, name)) in {"Succeeded", "Failed", "Halted"} and p,
        timeout,
        f"WeightRefit {name} to finish",
        every=2,
    )
    assert phase == "Succeeded", (
        json.dumps(kubectl_json(node, "get", "weightrefit", name, "-n", NS).get("status"))
        + operator_logs(node)[-4000:]
    )


# --- stage 1-2: the node, and a plain pod ------------------------------------------------------


@pytest.mark.timeout(1800)
def test_node_registers_ready(node: Node) -> None:
    n = kubectl_json(node, "get", "node", NODE_NAME)
    info = n["status"]["nodeInfo"]
    assert info["kubeletVersion"].startswith("v1.36"), info
    assert info["containerRuntimeVersion"].startswith("containerd://2."), info
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
    node.cp.kubectl("create", "namespace", NS)
    # kube-controller-manager is up: the namespace gets its default ServiceAccount and CA.
    wait_for(
        lambda: (
            node.cp.kubectl("get", "sa", "default", "-n", NS, check=False).returncode == 0
            and node.cp.kubectl("get", "cm", "kube-root-ca.crt", "-n", NS, check=False).returncode
            == 0
        ),
        60,
        "the namespace's default ServiceAccount and kube-root-ca.crt",
    )


@pytest.mark.timeout(180)
def test_busybox_pod_runs_on_the_bridge(node: Node) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "busybox"},
        "spec": {
            "containers": [
                {
                    "name": "web",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        "sh",
                        "-c",
                        "echo hello-from-pod > /tmp/index.html; exec httpd -f -p 8080 -h /tmp",
                    ],
                    "readinessProbe": {
                        "httpGet": {"path": "/index.html", "port": 8080},
                        "periodSeconds": 1,
                    },
                }
            ],
        },
    }
    node.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(pod))
    node.cp.kubectl("wait", "-n", NS, "--for=condition=Ready", "pod/busybox", "--timeout=120s")
    ip = kubectl_json(node, "get", "pod", "busybox", "-n", NS)["status"]["podIP"]
    assert ip.startswith(POD_SUBNET.rsplit(".", 2)[0]), ip
    with urllib.request.urlopen(f"http://{ip}:8080/index.html", timeout=5) as r:
        assert r.read().strip() == b"hello-from-pod"
    node.cp.kubectl("delete", "pod", "busybox", "-n", NS, "--grace-period=0", "--force")


# --- stage 3: the operator by Helm ------------------------------------------------------------


@pytest.mark.timeout(420)
def test_helm_install_gives_a_running_leading_operator(node: Node) -> None:
    helm = helm_binary()
    state["before_install"] = inventory(node)
    t = time.monotonic()
    proc = subprocess.run(
        [str(helm), f"--kubeconfig={node.kubeconfig}", *helm_install_args(RELEASE, NS)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    pods = node.cp.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
    assert proc.returncode == 0, f"{proc.stderr}\n{pods}\n{operator_logs(node)}"
    log(f"helm install --wait: {time.monotonic() - t:.1f}s")
    items = kubectl_json(
        node, "get", "pods", "-n", NS, "-l", "app.kubernetes.io/name=refit-operator"
    )["items"]
    assert len(items) == 1, [p["metadata"]["name"] for p in items]
    pod = items[0]
    assert pod["status"]["phase"] == "Running"
    assert pod["spec"]["nodeName"] == NODE_NAME
    # Its token is a projected, bound ServiceAccount token (in-cluster config) and it leads.
    name = pod["metadata"]["name"]
    lease = wait_for(
        lambda: node.cp.kubectl("get", "lease", "-n", NS, "-o", "json", check=False).stdout or "{}",
        5,
        "leases",
    )
    holder = wait_for(
        lambda: [
            le["spec"].get("holderIdentity")
            for le in kubectl_json(node, "get", "lease", "-n", NS)["items"]
            if (le["spec"].get("holderIdentity") or "").startswith(name)
        ],
        90,
        f"{name} to hold the Lease",
    )
    log(f"operator {name} leads (holder {holder}); leases: {len(json.loads(lease)['items'])}")
    # kubectl logs reaches the kubelet (the API server's kubelet client cert).
    logs = node.cp.kubectl("logs", "-n", NS, name).stdout
    assert "leader lease" in logs and "acquired" in logs, logs[-2000:]
    state["operator_pod"] = name


# --- stage 4: the fleet and a refit, watched through the EndpointSlices --------------------------


@pytest.mark.timeout(900)
def test_fleet_refit_moves_endpoints_only_after_the_probe(node: Node) -> None:
    model = ensure_tiny_model()
    state["model"] = model
    token = os.urandom(16).hex()
    node.cp.kubectl(
        "create", "secret", "generic", ADMIN_SECRET, "-n", NS, f"--from-literal=token={token}"
    )
    node.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(fleet_service(FLEET)))
    dep = vllm_deployment(FLEET, REPLICAS, model)
    node.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(dep))
    t = time.monotonic()

    def containers_started() -> bool:
        pods = fleet_pods(node)
        return len(pods) == REPLICAS and all(started_since(p) is not None for p in pods)

    wait_for(containers_started, 480, "vLLM containers to pass their startupProbe", every=2)
    log(f"{REPLICAS} vLLM pods' containers started in {time.monotonic() - t:.1f}s")
    time.sleep(3)  # three periods of the readiness probe
    # Neither the gate is set nor has a pass vouched for the weights: /refit/ready is 503.
    pods = fleet_pods(node)
    assert all(gate(p) != "True" for p in pods), [gate(p) for p in pods]
    assert not any(c.get("ready") for p in pods for c in p["status"]["containerStatuses"]), [
        p["status"]["containerStatuses"] for p in pods
    ]

    watcher = EndpointSliceWatcher(node.cp.kubectl, NS, FLEET).start()
    state["watcher"] = watcher
    try:
        time.sleep(2)
        assert not any(watcher.ready_now().values()), watcher.ready_now()
        t = time.monotonic()
        apply_refit(node, "to-a", "A")
        log(f"refit to A: {time.monotonic() - t:.1f}s")
        pods = fleet_pods(node)
        assert all(serving(p, "A") for p in pods), [progress(p) for p in pods]
        wait_for(lambda: sum(watcher.ready_now().values()) == REPLICAS, 30, "both endpoints")
        for p in pods:
            became_ready = [t for t, r in watcher.history(p["metadata"]["name"]) if r]
            assert became_ready and became_ready[0] >= progress(p)["finished"] - 0.5, (
                watcher.history(p["metadata"]["name"]),
                progress(p)["finished"],
            )

        # The refit the issue is about: every pod leaves the Service while it is refitted and
        # comes back only after its probe passed.
        since = time.time()
        t = time.monotonic()
        apply_refit(node, "to-b", "B")
        log(f"refit to B: {time.monotonic() - t:.1f}s")
        wait_for(lambda: sum(watcher.ready_now().values()) == REPLICAS, 30, "both endpoints")
        for p in fleet_pods(node):
            name, prog = p["metadata"]["name"], progress(p)
            hist = watcher.history(name, since)
            assert serving(p, "B"), prog
            assert after_leading_true(hist) == [False, True], hist
            left = next(t for t, r in hist if not r)
            back = hist[-1][0]
            assert left >= prog["left_traffic"] - 0.5, (hist, prog["left_traffic"])
            assert back >= prog["finished"] - 0.5, (hist, prog["finished"])
            log(
                f"{name}: out of the EndpointSlice {back - left:.1f}s; probe "
                f"{prog['probe'].get('verdict')} at {prog['finished']:.1f}"
            )
    except BaseException:
        watcher.stop()
        raise


# --- stage 5: a killed vLLM process, a deleted pod ---------------------------------------------


def _container_pid(node: Node, pod: dict[str, Any]) -> int:
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    out = node.ctr("tasks", "ls").stdout.splitlines()
    for line in out[1:]:
        parts = line.split()
        if parts and parts[0] == cid:
            return int(parts[1])
    raise AssertionError(f"no task {cid} in {out}")


@pytest.mark.timeout(600)
def test_killed_vllm_process_is_restarted_and_reconverged(node: Node) -> None:
    """vLLM dies; the kubelet restarts it on its boot checkpoint while the pod's readiness
    condition still says True (the operator has not seen the restart yet). With the operator
    frozen for as long as that lasts, only the worker's /refit/ready keeps the pod out of the
    Service; once thawed, the operator's new pass brings it back on the refit's version."""
    watcher: EndpointSliceWatcher = state["watcher"]
    pod = fleet_pods(node)[0]
    name, before = pod["metadata"]["name"], restarts(pod)
    pid = _container_pid(node, pod)
    operator_pid = _container_pid(
        node, kubectl_json(node, "get", "pod", state["operator_pod"], "-n", NS)
    )
    since = time.time()
    os.kill(operator_pid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        log(f"operator frozen (pid {operator_pid}); killed vLLM (pid {pid}) in {name}")
        wait_for(
            lambda: restarts(kubectl_json(node, "get", "pod", name, "-n", NS)) > before,
            120,
            "kubelet to restart the container",
        )
        wait_for(
            lambda: started_since(kubectl_json(node, "get", "pod", name, "-n", NS)),
            300,
            "the restarted vLLM to pass its startupProbe",
        )
        time.sleep(3)  # three periods of the readiness probe
        pod = kubectl_json(node, "get", "pod", name, "-n", NS)
        assert gate(pod) == "True", pod["status"]  # stale: the process it vouched for is gone
        assert not pod["status"]["containerStatuses"][0]["ready"], pod["status"]
        assert not watcher.ready_now().get(name), watcher.history(name, since)
    finally:
        os.kill(operator_pid, signal.SIGCONT)
    log(f"restarted {name} stayed out of the Service with its gate True; operator thawed")
    t = time.monotonic()
    wait_converged(node, name, "B", since, 480)
    log(f"{name} reconverged {time.monotonic() - t:.1f}s after the restart was seen")
    wait_for(lambda: watcher.ready_now().get(name), 30, f"{name} endpoint ready")
    prog = progress(kubectl_json(node, "get", "pod", name, "-n", NS))
    hist = watcher.history(name, since)
    # Out when the process died, back only after the operator's new pass: never in between.
    assert after_leading_true(hist) == [False, True], hist
    assert hist[-1][0] >= prog["finished"] - 0.5, (hist, prog)
    assert prog["started"] >= since - 1, prog  # a new pass, after the kill


@pytest.mark.timeout(600)
def test_deleted_pod_replacement_converges(node: Node) -> None:
    watcher: EndpointSliceWatcher = state["watcher"]
    names = {p["metadata"]["name"] for p in fleet_pods(node)}
    victim = sorted(names)[-1]
    since = time.time()
    node.cp.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
    new = wait_for(
        lambda: [
            p["metadata"]["name"] for p in fleet_pods(node) if p["metadata"]["name"] not in names
        ],
        60,
        "a replacement pod",
    )[0]
    log(f"{victim} deleted; replacement {new}")
    wait_converged(node, new, "B", since, 540)
    wait_for(lambda: watcher.ready_now().get(new), 30, f"{new} endpoint ready")
    prog = progress(kubectl_json(node, "get", "pod", new, "-n", NS))
    hist = watcher.history(new, since)
    assert hist[-1][1] and [r for _, r in hist].count(True) == 1, hist
    assert hist[-1][0] >= prog["finished"] - 0.5, (hist, prog)
    assert victim not in watcher.ready_now(), watcher.ready_now()


# --- stage 5c: the operator's container killed in the middle of a refit ----------------------


def lease_holder(node: Node) -> tuple[str, int]:
    """(holder, leaseTransitions): the operator's fencing epoch is the transitions count."""
    spec = kubectl_json(node, "get", "lease", OPERATOR_LEASE, "-n", NS)["spec"]
    return str(spec.get("holderIdentity")), int(spec.get("leaseTransitions", 0))


def kill_at_first_pass_step(node: Node, pid: int, version: str, timeout: float) -> dict[str, Any]:
    """Watch the fleet's pods; the moment one records a pass to `version` that has begun but
    not finished, SIGKILL `pid`. Returns that pod's progress then."""
    api = k8s_config.new_client_from_config(str(node.kubeconfig))
    try:
        w = k8s_watch.Watch()
        for ev in w.stream(
            k8s.CoreV1Api(api).list_namespaced_pod,
            NS,
            label_selector="app=rollout",
            timeout_seconds=int(timeout),
        ):
            annotations = ev["object"].metadata.annotations or {}
            text = annotations.get(PROGRESS_ANNOTATION)
            prog = json.loads(text) if text else {}
            if prog.get("version") == version and not prog.get("outcome"):
                os.kill(pid, signal.SIGKILL)
                w.stop()
                return prog
    finally:
        api.close()
    raise AssertionError(f"no pass to {version} seen in flight within {timeout:.0f}s")


@pytest.mark.timeout(600)
def test_operator_killed_mid_refit_resumes_on_its_restart(node: Node) -> None:
    """The operator's container dies while a pod is mid-pass (out of traffic, weights half
    moved). The kubelet restarts it; the new process (same pod, same pid 1, a new identity)
    takes the Lease over once the old one's expires, resumes, and the refit succeeds with
    no pod back in traffic before its probe."""
    watcher: EndpointSliceWatcher = state["watcher"]
    op = kubectl_json(node, "get", "pod", state["operator_pod"], "-n", NS)
    op_restarts, pid, holder = restarts(op), _container_pid(node, op), lease_holder(node)
    since = time.time()
    body = weightrefit(
        "back-to-a", "A", state["model"].checkpoints["A"], sequence={"sleepLevel": 1}
    )
    # The watch is open before the refit exists, so no step can slip past it.
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_at_first_pass_step, node, pid, "A", 120)
        time.sleep(2)
        node.cp.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(body))
        prog = killed.result()
    log(f"operator (pid {pid}) killed while a pod was at step {prog.get('step')!r}")
    wait_for(
        lambda: (
            restarts(kubectl_json(node, "get", "pod", state["operator_pod"], "-n", NS))
            > op_restarts
        ),
        120,
        "kubelet to restart the operator's container",
    )
    phase = wait_for(
        lambda: (p := refit_phase(node, "back-to-a")) in {"Succeeded", "Failed", "Halted"} and p,
        300,
        "WeightRefit back-to-a to finish after the operator's restart",
        every=2,
    )
    status = kubectl_json(node, "get", "weightrefit", "back-to-a", "-n", NS).get("status")
    assert phase == "Succeeded", json.dumps(status) + operator_logs(node)[-4000:]
    # A new process is a new leader, even as the same pod and pid: a new identity and a new
    # fencing epoch, so its tokens are above every one its predecessor handed the pods.
    new_holder = lease_holder(node)
    assert new_holder[0] != holder[0] and new_holder[0].startswith(state["operator_pod"]), (
        holder,
        new_holder,
    )
    assert new_holder[1] > holder[1], (holder, new_holder)
    wait_for(lambda: sum(watcher.ready_now().values()) == REPLICAS, 30, "both endpoints")
    for p in fleet_pods(node):
        name, pp = p["metadata"]["name"], progress(p)
        assert serving(p, "A"), pp
        hist = watcher.history(name, since)
        assert after_leading_true(hist) == [False, True], (name, hist)
        assert hist[-1][0] >= pp["finished"] - 0.5, (name, hist, pp)


# --- stage 6: helm uninstall --------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_helm_uninstall_leaves_only_what_the_docs_keep(node: Node) -> None:
    watcher: EndpointSliceWatcher | None = state.get("watcher")
    if watcher:
        watcher.stop()
    node.cp.kubectl("delete", "deployment", FLEET, "-n", NS, "--wait=true", "--timeout=120s")
    helm = helm_binary()
    proc = subprocess.run(
        [
            str(helm),
            f"--kubeconfig={node.kubeconfig}",
            "uninstall",
            RELEASE,
            "-n",
            NS,
            "--wait",
            "--timeout",
            "2m",
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr

    # Everything that exists now and did not before `helm install` must be what docs/node.md
    # and the chart's README say stays: the CRD (Helm never deletes a chart's crds/) and so
    # the WeightRefits, and the operator's leader Lease (the operator makes it, not the
    # chart); besides what the tests made themselves (the fleet's Secret and Service, whose
    # EndpointSlice the control plane keeps). Garbage collection of the fleet's ReplicaSet
    # and pods, and of the operator's, is asynchronous: wait for the set to settle.
    kept_by_design = {
        ("CustomResourceDefinition", "", "weightrefits.refit.rollout.dev"),
        # kube-apiserver's own registration of the CRD's group version; goes with the CRD.
        ("APIService", "", "v1alpha1.refit.rollout.dev"),
        ("WeightRefit", NS, "to-a"),
        ("WeightRefit", NS, "to-b"),
        ("WeightRefit", NS, "back-to-a"),
        ("Lease", NS, OPERATOR_LEASE),
    }
    made_by_tests = {
        ("Secret", NS, ADMIN_SECRET),
        ("Service", NS, FLEET),
        ("Endpoints", NS, FLEET),
        # The fleet Service's ClusterIP allocation.
        (
            "IPAddress",
            "",
            kubectl_json(node, "get", "service", FLEET, "-n", NS)["spec"]["clusterIP"],
        ),
    }

    def unexplained() -> set[tuple[str, str, str]]:
        new = inventory(node) - state["before_install"] - kept_by_design - made_by_tests
        return {o for o in new if not (o[0] == "EndpointSlice" and o[2].startswith(FLEET + "-"))}

    extra: set[tuple[str, str, str]] = set()

    def settled() -> bool:
        nonlocal extra
        extra = unexplained()
        return not extra

    try:
        wait_for(settled, 120, "only the documented objects to remain")
    except AssertionError:
        raise AssertionError(f"left behind after helm uninstall: {sorted(extra)}") from None
    left = inventory(node)
    assert kept_by_design <= left, sorted(kept_by_design - left)
    log(f"after helm uninstall, kept: {sorted(kept_by_design)}")
