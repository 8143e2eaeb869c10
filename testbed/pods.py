"""Pod objects for workers on loopback addresses. The test control plane has no kubelet, so
whoever starts a worker creates its Pod and plays the kubelet: Running at the worker's IP."""

from __future__ import annotations

from typing import Any

from refit_worker.contract import READINESS_GATE


def register_pod(
    core: Any,
    namespace: str,
    name: str,
    ip: str,
    *,
    labels: dict[str, str],
    image: str,
    gate: bool = True,
) -> None:
    """Create the Pod (with the weights-ready readiness gate unless gate=False) through a
    kubernetes CoreV1Api, then set status.phase Running and status.podIP = ip."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "containers": [{"name": "vllm", "image": image}],
            "readinessGates": [{"conditionType": READINESS_GATE}] if gate else [],
        },
    }
    core.create_namespaced_pod(namespace, body)
    status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}
    core.patch_namespaced_pod_status(name, namespace, status)
