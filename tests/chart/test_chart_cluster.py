"""The chart against a real kube-apiserver: server-side validation, install, and the RBAC it
grants checked with real requests made AS the chart's ServiceAccount."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.controlplane import ControlPlane
from tests.chart.chartkit import ALL_OPTIONS, CHART, Helm, fleet_docs

pytestmark = pytest.mark.cluster

RELEASE = "refit"
SA = "refit-refit-operator"  # the chart's default ServiceAccount name for release "refit"


def _apply_dry_run(cp: ControlPlane, docs: list[dict[str, Any]], namespace: str) -> str:
    manifest = yaml.safe_dump_all(docs)
    proc = cp.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("values", [None, ALL_OPTIONS], ids=["default", "all-options"])
def test_rendered_chart_passes_server_side_dry_run(
    control_plane: ControlPlane,
    weightrefit_crd: str,
    monitoring_crds: list[str],
    helm: Helm,
    namespace: str,
    values: Path | None,
) -> None:
    """Every object the chart renders, the ServiceMonitor and PrometheusRule included
    (against the Prometheus Operator's real CRDs), is accepted by the API server."""
    docs = helm.template(*([values] if values else []), namespace=namespace)
    if values is not None:
        assert set(monitoring_crds) <= {d["kind"] for d in docs}
    out = _apply_dry_run(control_plane, docs, namespace)
    for d in docs:
        assert f"{d['metadata']['name']} created (server dry run)" in out, (d["kind"], out)
    # Nothing was persisted.
    got = control_plane.kubectl("get", "deploy", "-n", namespace, "-o", "name").stdout
    assert got.strip() == ""


def test_monitoring_schemas_are_enforced(
    control_plane: ControlPlane,
    monitoring_crds: list[str],
    helm: Helm,
    namespace: str,
) -> None:
    """The dry run above means something: the same CRDs refuse a ServiceMonitor and a
    PrometheusRule with a field of the wrong type."""
    docs = helm.template(ALL_OPTIONS, namespace=namespace)
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    monitor["spec"]["endpoints"][0]["interval"] = 30  # a duration string, not a number
    rule["spec"]["groups"][0]["rules"] = "not a list"
    for bad in (monitor, rule):
        proc = control_plane.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-",
            input=yaml.safe_dump(bad), check=False,
        )  # fmt: skip
        assert proc.returncode != 0, (bad["kind"], proc.stdout)
        assert "Invalid value" in proc.stderr or "must be of type" in proc.stderr, proc.stderr


def test_example_fleet_passes_server_side_dry_run(
    control_plane: ControlPlane, weightrefit_crd: str, namespace: str
) -> None:
    docs = fleet_docs()
    out = _apply_dry_run(control_plane, docs, namespace)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Secret",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "WeightRefit",
    } <= kinds
    assert out.count("(server dry run)") == len(docs)


def _as(
    cp: ControlPlane, kubeconfig: Path, *args: str, input: str | None = None
) -> tuple[int, str]:
    proc = cp.kubectl(*args, kubeconfig=kubeconfig, input=input, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _can_i(cp: ControlPlane, kubeconfig: Path, *args: str) -> bool:
    """SelfSubjectAccessReview as that identity (kubectl auth can-i)."""
    proc = cp.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.returncode == 0


def _pod(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "rollout"}},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}]},
        }
    )


def _secret(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "stringData": {"token": f"{name}-value"},
        }
    )


@pytest.fixture
def installed(
    control_plane: ControlPlane, weightrefit_crd: str, helm: Helm, namespace: str
) -> tuple[str, Path]:
    """The chart installed (no --wait: there is no kubelet) and a kubeconfig for its SA."""
    out = helm.run(
        "install",
        RELEASE,
        str(CHART),
        f"--namespace={namespace}",
        "--set=trainers.subjects[0].kind=ServiceAccount",
        "--set=trainers.subjects[0].name=trainer",
        kubeconfig=control_plane.kubeconfig,
    ).stdout
    # NOTES.txt: scope, the readable Secret and the security warning reach the installer.
    assert f"It watches WeightRefits in: {namespace} (namespaced Roles)" in out
    assert (
        "Secrets the operator may read (admin tokens, API keys): vllm-admin-token, vllm-api-key."
        in out
    )
    assert "whoever may create a WeightRefit decides which checkpoint" in out
    status = helm.run(
        "status",
        RELEASE,
        f"--namespace={namespace}",
        "-o",
        "json",
        kubeconfig=control_plane.kubeconfig,
    )
    assert json.loads(status.stdout)["info"]["status"] == "deployed"
    return namespace, control_plane.as_service_account(namespace, SA)


def test_installed_service_account_is_refused_what_it_must_not_do(
    control_plane: ControlPlane, installed: tuple[str, Path]
) -> None:
    cp = control_plane
    ns, sa = installed
    other = cp.create_namespace("chart-other")
    for n in (ns, other):
        cp.kubectl("apply", "-n", n, "-f", "-", input=_pod("victim"))
        cp.kubectl("apply", "-n", n, "-f", "-", input=_secret("vllm-admin-token"))
        cp.kubectl("apply", "-n", n, "-f", "-", input=_secret("db-password"))

    # What it needs, in its namespace.
    rc, out = _as(cp, sa, "get", "secret", "vllm-admin-token", "-n", ns, "-o", "json")
    assert rc == 0, out
    assert json.loads(out)["data"]["token"]
    rc, out = _as(cp, sa, "get", "pods", "-n", ns)
    assert rc == 0 and "victim" in out, out
    rc, out = _as(cp, sa, "get", "weightrefits", "-n", ns)
    assert rc == 0, out
    rc, out = _as(
        cp,
        sa,
        "patch",
        "pod",
        "victim",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "conditions": [{"type": "refit.rollout.dev/weights-ready", "status": "False"}]
                }
            }
        ),
    )
    assert rc == 0, out
    assert _can_i(cp, sa, "create", "leases.coordination.k8s.io", "-n", ns)
    assert _can_i(cp, sa, "create", "events", "-n", ns)

    # What it must not do: each a real request, refused by the API server.
    refused = {
        "delete a fleet pod": ("delete", "pod", "victim", "-n", ns, "--wait=false"),
        # Pods are written only through pods/status: no right to change a pod's spec.
        "change a fleet pod's image": (
            "set",
            "image",
            "pod/victim",
            "c=evil:latest",
            "-n",
            ns,
        ),
        "read another Secret": ("get", "secret", "db-password", "-n", ns),
        "list Secrets": ("get", "secrets", "-n", ns),
        "read the admin token in another namespace": (
            "get",
            "secret",
            "vllm-admin-token",
            "-n",
            other,
        ),
        "read pods in another namespace": ("get", "pods", "-n", other),
        "patch a pod in another namespace": ("label", "pod", "victim", "-n", other, "pwned=1"),
        "list WeightRefits in another namespace": ("get", "weightrefits", "-n", other),
        "edit the CRD": ("label", "crd", "weightrefits.refit.rollout.dev", "pwned=1"),
        "delete the CRD": ("delete", "crd", "weightrefits.refit.rollout.dev", "--wait=false"),
    }
    for what, args in refused.items():
        rc, out = _as(cp, sa, *args)
        # kubectl words some refusals "is forbidden"
        assert rc != 0 and "forbidden" in out.lower(), (
            f"{what}: expected Forbidden, got {rc}: {out}"
        )
    rc, out = _as(cp, sa, "create", "-n", ns, "-f", "-", input=_pod("intruder"))
    assert rc != 0 and "Forbidden" in out, out
    rc, out = _as(cp, sa, "create", "-n", ns, "-f", "-", input=_secret("planted"))
    assert rc != 0 and "Forbidden" in out, out

    # The same answers from SelfSubjectAccessReview, plus verbs kubectl has no single command for.
    assert not _can_i(cp, sa, "delete", "pods", "-n", ns)
    assert not _can_i(cp, sa, "create", "pods/exec", "-n", ns)
    assert not _can_i(cp, sa, "create", "weightrefits", "-n", ns)
    # delete is granted in the watched namespaces only: garbage collection of finished refits.
    assert _can_i(cp, sa, "delete", "weightrefits", "-n", ns)
    assert not _can_i(cp, sa, "delete", "weightrefits", "-n", other)
    assert not _can_i(cp, sa, "update", "customresourcedefinitions")
    assert not _can_i(cp, sa, "create", "rolebindings", "-n", ns)
    assert not _can_i(cp, sa, "patch", "pods", "-n", other)
    assert not _can_i(cp, sa, "patch", "pods", "-n", ns)
    assert _can_i(cp, sa, "patch", "pods", "--subresource=status", "-n", ns)
    assert not _can_i(cp, sa, "update", "leases.coordination.k8s.io/some-other-lease", "-n", ns)

    # The right it has, pods/status, does not reach the spec either: the API server keeps the
    # old spec on a status patch (the request itself is accepted).
    spec_patch = {"spec": {"containers": [{"name": "c", "image": "evil:latest"}]}}
    rc, out = _as(cp, sa, "patch", "pod", "victim", "-n", ns, "--subresource=status",
                  "--type=strategic", "-p", json.dumps(spec_patch))  # fmt: skip
    assert rc == 0, out

    # Nothing it was refused happened.
    mine = json.loads(cp.kubectl("get", "pod", "victim", "-n", ns, "-o", "json").stdout)
    assert [c["image"] for c in mine["spec"]["containers"]] == ["example.invalid/none"]
    labels = json.loads(cp.kubectl("get", "pod", "victim", "-n", other, "-o", "json").stdout)
    assert "pwned" not in labels["metadata"].get("labels", {})


def test_cluster_scope_reads_every_namespace_but_still_only_named_secrets(
    control_plane: ControlPlane, weightrefit_crd: str, helm: Helm, namespace: str
) -> None:
    cp = control_plane
    release = "refit-wide"
    helm.run(
        "install",
        release,
        str(CHART),
        f"--namespace={namespace}",
        "--set=watch.scope=Cluster",
        "--set=probeReferences.configMapNames={probe-reference}",
        kubeconfig=cp.kubeconfig,
    )
    sa = cp.as_service_account(namespace, f"{release}-refit-operator")
    other = cp.create_namespace("chart-wide")
    cp.kubectl("apply", "-n", other, "-f", "-", input=_secret("vllm-admin-token"))
    cp.kubectl("apply", "-n", other, "-f", "-", input=_secret("db-password"))
    for cm in ("probe-reference", "unrelated-config"):
        cp.kubectl("create", "configmap", cm, "-n", other, "--from-literal=k=v")
    try:
        rc, out = _as(cp, sa, "get", "configmap", "probe-reference", "-n", other)
        assert rc == 0, out
        rc, out = _as(cp, sa, "get", "configmap", "unrelated-config", "-n", other)
        assert rc != 0 and "Forbidden" in out, out
        assert _can_i(cp, sa, "patch", "pods", "--subresource=status", "-n", other)
        assert _can_i(cp, sa, "watch", "weightrefits", "--all-namespaces")
        rc, out = _as(cp, sa, "get", "secret", "vllm-admin-token", "-n", other)
        assert rc == 0, out
        rc, out = _as(cp, sa, "get", "secret", "db-password", "-n", other)
        assert rc != 0 and "Forbidden" in out, out
        assert not _can_i(cp, sa, "delete", "pods", "-n", other)
        assert not _can_i(cp, sa, "list", "secrets", "--all-namespaces")
    finally:
        # Cluster-scoped objects outlive the namespace: remove them for later tests.
        helm.run("uninstall", release, f"--namespace={namespace}", kubeconfig=cp.kubeconfig)


def _weightrefit(name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "refit.rollout.dev/v1alpha1",
            "kind": "WeightRefit",
            "metadata": {"name": name},
            "spec": {
                "fleet": {"selector": {"matchLabels": {"app": "rollout"}}},
                "checkpoint": {"path": f"/checkpoints/{name}", "version": name},
            },
        }
    )


def test_only_bound_trainers_may_create_weightrefits(
    control_plane: ControlPlane, installed: tuple[str, Path]
) -> None:
    """Creating a WeightRefit decides what the fleet loads: only the trainer subjects may."""
    cp = control_plane
    ns, operator_sa = installed
    trainer = cp.as_service_account(ns, "trainer")
    stranger = cp.as_service_account(ns, "stranger")
    rc, out = _as(cp, trainer, "create", "-n", ns, "-f", "-", input=_weightrefit("step-1"))
    assert rc == 0, out
    for who in (stranger, operator_sa):
        rc, out = _as(cp, who, "create", "-n", ns, "-f", "-", input=_weightrefit("step-2"))
        assert rc != 0 and "Forbidden" in out, out
    other = cp.create_namespace("chart-trainer")
    rc, out = _as(cp, trainer, "create", "-n", other, "-f", "-", input=_weightrefit("step-3"))
    assert rc != 0 and "Forbidden" in out, out
    # Read-only on the fleet: enough for `kubectl refit status|plan|wait`, nothing more.
    assert _can_i(cp, trainer, "list", "pods", "-n", ns)
    assert _can_i(cp, trainer, "list", "events", "-n", ns)
    assert not _can_i(cp, trainer, "patch", "pods", "-n", ns)
    assert not _can_i(cp, trainer, "get", "secrets", "-n", ns)
    # A broadcasting trainer writes its transfer manifest and announces each round on the
    # refit (the spec itself is immutable: CEL); the status stays the operator's.
    assert _can_i(cp, trainer, "create", "configmaps", "-n", ns)
    assert _can_i(cp, trainer, "patch", "weightrefits", "-n", ns)
    assert not _can_i(cp, trainer, "patch", "weightrefits", "--subresource=status", "-n", ns)
    assert not _can_i(cp, trainer, "get", "configmaps", "-n", ns)
    names = cp.kubectl("get", "weightrefits", "-n", ns, "-o", "name").stdout.split()
    assert names == ["weightrefit.refit.rollout.dev/step-1"]


def _pod_from_template(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    template = deploy["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": name},
        "spec": template["spec"],
    }


def test_operator_and_fleet_pods_pass_the_restricted_pod_security_standard(
    control_plane: ControlPlane, helm: Helm, namespace: str
) -> None:
    """The API server's PodSecurity admission, enforcing `restricted`, admits both pods."""
    cp = control_plane
    cp.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    operator = next(d for d in helm.template(namespace=namespace) if d["kind"] == "Deployment")
    fleet = next(d for d in fleet_docs() if d["kind"] == "Deployment")
    pods = [_pod_from_template(operator, "operator"), _pod_from_template(fleet, "fleet")]
    for pod in pods:
        out = _apply_dry_run(cp, [pod], namespace)
        assert "created (server dry run)" in out
    # Control: the admission really enforces here (a pod allowing escalation is refused).
    weakened = _pod_from_template(operator, "weakened")
    del weakened["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    proc = cp.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(weakened), check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and 'violates PodSecurity "restricted' in proc.stderr, proc.stderr
