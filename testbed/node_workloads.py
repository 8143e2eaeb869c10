"""What the real-node tests run on the node (testbed/node.py): the operator by Helm, a fleet
of vLLM CPU pods, and a watcher of a Service's EndpointSlices.

The vLLM pods run the worker runtime image (testbed/node_images.WORKER_IMAGE: Debian
libraries only) with the test venv, its base Python and this checkout mounted read-only from
the host at their own paths (hostPath), and the tiny model's folder likewise; see
docs/node.md for the trade-off against a self-contained worker image.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_client.refit_document import build_refit
from refit_worker.contract import READINESS_GATE, READY_PATH

from testbed.node_images import OPERATOR_IMAGE, WORKER_IMAGE
from testbed.tiny_model import TinyModel
from testbed.vllm_server import ENGINE_ENV, engine_args

REPO = Path(__file__).resolve().parents[1]
HELM_SCRIPT = REPO / "hack" / "helm.sh"
CHART = REPO / "charts" / "refit-operator"
FLEET_LABELS = {"app": "rollout"}
VLLM_PORT = 8000
ADMIN_SECRET = "vllm-admin-token"


def helm_binary() -> Path:
    out = subprocess.run(["bash", str(HELM_SCRIPT)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"hack/helm.sh failed: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def helm_install_args(release: str, namespace: str) -> list[str]:
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    return [
        "install",
        release,
        str(CHART),
        "-n",
        namespace,
        "--set",
        f"image.repository={repo}",
        "--set",
        f"image.tag={tag}",
        "--set",
        "image.pullPolicy=Never",
        "--wait",
        "--timeout",
        "5m",
    ]


def venv_base_prefix() -> Path:
    """The base installation of the venv's Python (pyenv, python.org build, /usr): the
    venv's interpreter is a symlink into it, so pods mount it too."""
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-c", "import sys; print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def vllm_deployment(
    name: str, replicas: int, model: TinyModel, *, memory_limit: str = "5Gi"
) -> dict[str, Any]:
    """A Deployment of vLLM CPU pods with the weights-ready readiness gate, started like
    testbed/vllm_server.py starts a server (the tiny model, --load-format dummy)."""
    base = venv_base_prefix()
    # The checkout's .venv may be a link to a venv elsewhere (a second worktree sharing one):
    # the pod follows the link, so it mounts the venv where the link points as well.
    # Each folder is mounted once: one inside an earlier one is not mounted again.
    mounts = {"repo": REPO}
    for key, path in (("venv", (REPO / ".venv").resolve()), ("python", base)):
        if not any(path.is_relative_to(p) for p in mounts.values()):
            mounts[key] = path
    mounts["models"] = model.root
    python = REPO / ".venv" / "bin" / "python"
    env = {
        **ENGINE_ENV,
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "REFIT_ALLOWED_ROOT": str(model.allowed_root),
        "REFIT_ADMIN_TOKEN_FILE": "/etc/refit/admin-token/token",
        "PYTHONPATH": f"{REPO}:{REPO / 'worker_image'}",
    }
    args = engine_args(model.base_dir, model.base_dir, "0.0.0.0", VLLM_PORT)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": FLEET_LABELS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": FLEET_LABELS},
            # One pod at a time on a 2-core node; a new pod waits for the old one to go.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": FLEET_LABELS},
                "spec": {
                    "readinessGates": [{"conditionType": READINESS_GATE}],
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 5,
                    "enableServiceLinks": False,
                    "containers": [
                        {
                            "name": "vllm",
                            "image": WORKER_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": [str(python)],
                            "args": args,
                            "env": [{"name": k, "value": v} for k, v in env.items()],
                            "ports": [{"name": "http", "containerPort": VLLM_PORT}],
                            # As examples/fleet/fleet.yaml: started once vLLM answers,
                            # ready once a refit pass probed its weights.
                            "startupProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 2,
                                "failureThreshold": 300,
                            },
                            "readinessProbe": {
                                "httpGet": {"path": READY_PATH, "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "1Gi"},
                                "limits": {"memory": memory_limit},
                            },
                            "volumeMounts": [
                                *(
                                    {"name": n, "mountPath": str(p), "readOnly": True}
                                    for n, p in mounts.items()
                                ),
                                {
                                    "name": "admin-token",
                                    "mountPath": "/etc/refit/admin-token",
                                    "readOnly": True,
                                },
                                {"name": "tmp", "mountPath": "/tmp"},
                                {"name": "shm", "mountPath": "/dev/shm"},
                            ],
                        }
                    ],
                    "volumes": [
                        *(
                            {"name": n, "hostPath": {"path": str(p), "type": "Directory"}}
                            for n, p in mounts.items()
                        ),
                        {"name": "admin-token", "secret": {"secretName": ADMIN_SECRET}},
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                    ],
                },
            },
        },
    }


def fleet_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": FLEET_LABELS},
        "spec": {
            "selector": FLEET_LABELS,
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}],
        },
    }


def weightrefit(name: str, version: str, path: Path, **spec: Any) -> dict[str, Any]:
    admin = {"adminTokenSecretRef": {"name": ADMIN_SECRET, "key": "token"}}
    return build_refit(
        name,
        str(path),
        version,
        fleet_selector=FLEET_LABELS,
        port=VLLM_PORT,
        strategy="AllAtOnce",
        spec_fields={"fleet": admin, **spec},
    )


@dataclass
class SliceEvent:
    t: float  # time.time()
    ready: dict[str, bool]  # pod name -> endpoint ready, for every endpoint in the slices


@dataclass
class EndpointSliceWatcher:
    """Polls the EndpointSlices of a Service (every 0.2 s, through kubectl) and keeps each
    change of the set of ready endpoints, by pod name."""

    kubectl: Any  # ControlPlane.kubectl
    namespace: str
    service: str
    events: list[SliceEvent] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> EndpointSliceWatcher:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last: dict[str, bool] | None = None
        while not self._stop.is_set():
            proc = self.kubectl(
                "get",
                "endpointslices",
                "-n",
                self.namespace,
                "-l",
                f"kubernetes.io/service-name={self.service}",
                "-o",
                "json",
                check=False,
            )
            if proc.returncode != 0:
                self.errors.append(proc.stderr.strip())
            else:
                now: dict[str, bool] = {}
                for es in json.loads(proc.stdout)["items"]:
                    for ep in es.get("endpoints") or []:
                        pod = (ep.get("targetRef") or {}).get("name", "?")
                        now[pod] = bool((ep.get("conditions") or {}).get("ready"))
                if now != last:
                    self.events.append(SliceEvent(time.time(), now))
                    last = now
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)

    def ready_now(self) -> dict[str, bool]:
        return dict(self.events[-1].ready) if self.events else {}

    def history(self, pod: str, since: float = 0.0) -> list[tuple[float, bool]]:
        """(time, ready) at each change of this pod's endpoint (absent counts as not ready)."""
        out: list[tuple[float, bool]] = []
        for ev in self.events:
            if ev.t < since:
                continue
            state = ev.ready.get(pod, False)
            if not out or out[-1][1] != state:
                out.append((ev.t, state))
        return out


def log(msg: str) -> None:
    print(f"[node] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)
