"""The chart renders, lints and validates its values (tests/unit/test_generated.py checks that
its copies of the CRDs, alerts and dashboards are current).

No API server needed: these run `helm lint` and `helm template` with the real Helm binary.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from refit_operator.core.podview import containers_up_in
from refit_worker.contract import READY_PATH

from tests.chart.chartkit import (
    ALL_OPTIONS,
    CHART,
    FLEET,
    REPO,
    SOURCE_ALERTS,
    SOURCE_DASHBOARDS,
    Helm,
    by_kind,
    fleet_docs,
    one,
)

READINESS_GATE_CONDITION = "refit.rollout.dev/weights-ready"


def _rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's own rules (the trainer Role is granted to people, not to the operator)."""
    return [
        r
        for d in docs
        if d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith("-trainer")
        for r in d["rules"]
    ]


def _verbs_on(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {
        v
        for r in rules
        if group in r["apiGroups"] and resource in r["resources"]
        for v in r["verbs"]
    }


# --- lint and render ----------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, ALL_OPTIONS], ids=["default", "all-options"])
def test_helm_lint_strict(helm: Helm, values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values:
        args.append(f"--values={values}")
    proc = helm.run(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_render_is_namespaced_and_least_privilege(helm: Helm) -> None:
    docs = helm.template(namespace="refit-system")
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    for d in docs:
        assert d["metadata"]["namespace"] == "refit-system", d["metadata"]["name"]

    rules = _rules(docs)
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
    assert _verbs_on(rules, "refit.rollout.dev", "weightrefits") == {
        "get",
        "list",
        "watch",
        "patch",
        "update",
        "delete",  # garbage collection of finished refits (history.py)
    }
    assert _verbs_on(rules, "refit.rollout.dev", "weightrefits/status") >= {"patch"}
    assert _verbs_on(rules, "refit.rollout.dev", "weightrefits/finalizers") == {"update"}
    assert _verbs_on(rules, "", "pods") == {"get", "list", "watch"}
    assert _verbs_on(rules, "", "pods/status") == {"get", "patch"}
    assert not _verbs_on(rules, "apiextensions.k8s.io", "customresourcedefinitions")
    # Secrets: get only, by name only.
    secret_rules = [r for r in rules if "secrets" in r["resources"]]
    assert secret_rules == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["vllm-admin-token", "vllm-api-key"],
            "verbs": ["get"],
        }
    ]

    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["command"] == ["refit-operator"]
    assert "--namespace=refit-system" in container["args"]
    assert "--lease-namespace=refit-system" in container["args"]
    assert "--lease-name=refit-refit-operator" in container["args"]
    assert "--verbose" not in container["args"]
    assert "--history-limit=10" in container["args"]
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"


def test_watch_namespaces_get_one_role_each(helm: Helm) -> None:
    docs = helm.template(sets=("watch.namespaces={team-a,team-b}",))
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in by_kind(docs, "Role")}
    assert roles == {
        ("team-a", "refit-refit-operator"),
        ("team-b", "refit-refit-operator"),
        ("refit-system", "refit-refit-operator-leader-election"),
        ("team-a", "refit-refit-operator-trainer"),
        ("team-b", "refit-refit-operator-trainer"),
    }
    # No trainer subjects given: nobody is bound to the trainer Roles.
    assert {d["metadata"]["name"] for d in by_kind(docs, "RoleBinding")} == {
        "refit-refit-operator",
        "refit-refit-operator-leader-election",
    }
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]


def test_all_options_render(helm: Helm) -> None:
    docs = helm.template(ALL_OPTIONS, namespace="refit-system")
    kinds = {d["kind"] for d in docs}
    assert {"ClusterRole", "ClusterRoleBinding", "ServiceMonitor", "PrometheusRule"} <= kinds
    assert not [
        d for d in by_kind(docs, "Role") if not d["metadata"]["name"].endswith("leader-election")
    ]
    rules = _rules(docs)
    (secret_rule,) = [r for r in rules if "secrets" in r["resources"]]
    assert secret_rule["resourceNames"] == ["vllm-admin-token", "other-fleet-admin-token"]
    assert secret_rule["verbs"] == ["get"]
    (cm_rule,) = [r for r in rules if "configmaps" in r["resources"]]
    assert cm_rule["resourceNames"] == ["probe-reference"]

    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 3
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/refit/refit-operator:0.1.0-test"
    # Cluster scope: no --namespace, so the operator watches every namespace.
    assert not [a for a in container["args"] if a.startswith("--namespace")]
    assert "--lease-name=refit-all" in container["args"]
    assert "--verbose" in container["args"]
    assert "--history-limit=3" in container["args"]
    assert container["args"][-1] == "--extra-flag-for-test"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9102, "protocol": "TCP"}]
    (lease_role,) = [d for d in by_kind(docs, "Role") if "leader-election" in d["metadata"]["name"]]
    assert {"resourceNames": ["refit-all"]}.items() <= lease_role["rules"][1].items()

    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"

    rule = one(docs, "PrometheusRule")
    source = yaml.safe_load(SOURCE_ALERTS.read_text())
    assert rule["spec"]["groups"] == source["groups"]

    dashboards = [d for d in by_kind(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    sources = sorted(SOURCE_DASHBOARDS.glob("*.json"))
    assert len(dashboards) == len(sources) > 0
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "Refit"
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((SOURCE_DASHBOARDS / key).read_text())


# --- values.schema.json ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("replicaCount=0", "at '/replicaCount': minimum"),
        ("historyLimit=-1", "at '/historyLimit': minimum"),
        ("watch.scope=Everywhere", "at '/watch/scope': value must be one of"),
        ("watch.namespaces={Bad_Name}", "at '/watch/namespaces/0'"),
        ("adminToken.secretNames={UPPER}", "at '/adminToken/secretNames/0'"),
        ("metrics.port=70000", "at '/metrics/port': maximum"),
        ("metrics.serviceMonitor.interval=soon", "at '/metrics/serviceMonitor/interval'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy': value must be one of"),
        ("operator.verbose=loud", "at '/operator/verbose': got string, want boolean"),
        ("unknownKey=1", "additional properties 'unknownKey' not allowed"),
    ],
)
def test_schema_rejects_bad_values_with_a_clear_message(
    helm: Helm, setting: str, message: str
) -> None:
    proc = helm.run("template", "refit", str(CHART), f"--set={setting}", check=False)
    assert proc.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == "", "nothing may render from bad values"


def test_servicemonitor_without_service_is_refused(helm: Helm) -> None:
    proc = helm.run(
        "template",
        "refit",
        str(CHART),
        "--set=metrics.serviceMonitor.enabled=true",
        "--set=metrics.service.enabled=false",
        check=False,
    )
    assert proc.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in proc.stderr


def test_chart_readme_documents_every_value() -> None:
    """The README's values table names every leaf key of values.yaml."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()

    def leaves(node: dict[str, Any], prefix: str = "") -> list[str]:
        out: list[str] = []
        for key, value in node.items():
            path = f"{prefix}{key}"
            if (
                isinstance(value, dict)
                and value
                and path not in ("resources", "probes.liveness", "probes.readiness")
            ):
                out.extend(leaves(value, path + "."))
            else:
                out.append(path)
        return out

    missing = [k for k in leaves(values) if f"`{k}`" not in readme]
    assert not missing, f"README.md values table lacks: {missing}"


# --- the example fleet (examples/fleet/) -------------------------------------------------


def test_example_fleet_manifests_carry_the_guard_settings() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in fleet_docs()}
    pod = docs[("Deployment", "rollout")]["spec"]["template"]["spec"]
    assert pod["readinessGates"] == [{"conditionType": "refit.rollout.dev/weights-ready"}]
    (vllm,) = pod["containers"]
    env = {e["name"]: e for e in vllm["env"]}
    assert env["REFIT_ALLOWED_ROOT"]["value"] == "/checkpoints"
    token_file = Path(env["REFIT_ADMIN_TOKEN_FILE"]["value"])
    assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"
    # The guard and the extension the pods load are the classes refit_worker defines.
    for flag in ("--middleware=", "--worker-extension-cls="):
        (arg,) = [a for a in vllm["args"] if a.startswith(flag)]
        module, _, cls = arg.removeprefix(flag).rpartition(".")
        source = REPO / "worker_image" / (module.replace(".", "/") + ".py")
        assert re.search(rf"^class {cls}\b", source.read_text(), re.M), arg
    # Ready only once a pass stamped this process's weights; started once vLLM answers, which
    # is then what the operator waits for before a pass (not ContainersReady).
    assert vllm["readinessProbe"]["httpGet"]["path"] == READY_PATH
    assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
    starting: dict[str, Any] = {"containerStatuses": [{"name": "vllm", "started": False}],
                "conditions": [{"type": "ContainersReady", "status": "False"}]}  # fmt: skip
    assert not containers_up_in(pod, starting)
    starting["containerStatuses"][0]["started"] = True
    assert containers_up_in(pod, starting)
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints"
    assert mounts["checkpoints"]["readOnly"] is True
    assert token_file.parent == Path(mounts["admin-token"]["mountPath"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "vllm-admin-token"
    assert docs[("Secret", "vllm-admin-token")]["stringData"]["token"]
    policy = docs[("NetworkPolicy", "rollout-ingress")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app": "rollout"}}
    assert policy["policyTypes"] == ["Ingress"]
    peers = [p for rule in policy["ingress"] for p in rule["from"]]
    assert {"app.kubernetes.io/name": "refit-operator"} in [
        p["podSelector"]["matchLabels"] for p in peers
    ]
    # Only the operator, the gateway and Prometheus reach the vLLM port; the broadcast rule
    # admits the fleet's pods and the trainer to gloo's ephemeral ports, which exclude it.
    vllm_rules = [r for r in policy["ingress"] if all("endPort" not in p for p in r["ports"])]
    assert len(vllm_rules) == 3
    assert all(port["port"] == 8000 for rule in vllm_rules for port in rule["ports"])
    (gloo,) = [r for r in policy["ingress"] if r not in vllm_rules]
    assert all(p["port"] > 8000 for p in gloo["ports"])
    assert {"app": "rollout"} in [p["podSelector"]["matchLabels"] for p in gloo["from"]]
    assert FLEET.joinpath("README.md").exists()


def test_rendered_prometheusrule_passes_promtool(
    helm: Helm, promtool: Path, tmp_path: Path
) -> None:
    """What the PrometheusRule carries is a valid Prometheus rules file (real promtool)."""
    docs = helm.template(sets=("prometheusRule.enabled=true",))
    rule = one(docs, "PrometheusRule")
    rules_file = tmp_path / "rendered-rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run(
        [str(promtool), "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_alerts = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {n_alerts} rules found" in proc.stdout


def test_security_doc_names_only_tests_that_exist() -> None:
    """docs/security.md backs each claim with a test name; each named test must exist."""
    doc = (REPO / "docs" / "security.md").read_text()
    # Function names, not module names (test_crd.py) or globs (test_guard*.py).
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b(?![.*a-z0-9_])", doc))
    assert len(named) >= 8
    defined: set[str] = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        defined.update(re.findall(r"^(?:async )?def (test_[a-z0-9_]+)", path.read_text(), re.M))
    missing = sorted(named - defined)
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"
