"""The WeightRefit CRD on a real kube-apiserver: install, examples, defaults, validation,
immutability, status round-trip, printer columns and `kubectl explain`."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from refit_worker.contract import PROBE_FILE, ProbeReference

from testbed.controlplane import CRD_DIR, REPO, ControlPlane

pytestmark = pytest.mark.cluster

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
Manifest = dict[str, Any]


def minimal(name: str = "wr") -> Manifest:
    return {
        "apiVersion": "refit.rollout.dev/v1alpha1",
        "kind": "WeightRefit",
        "metadata": {"name": name},
        "spec": {
            "fleet": {"selector": {"matchLabels": {"app": "rollout"}}},
            "checkpoint": {"path": "/checkpoints/step-1", "version": "step-1"},
        },
    }


def create(
    cp: ControlPlane, ns: str, obj: Manifest, *, dry_run: bool = False, check: bool = True
) -> Any:
    """Create with strict server-side field validation; returns the stored object or the
    failed kubectl run."""
    args = ["create", "-n", ns, "--validate=strict", "-o", "json", "-f", "-"]
    if dry_run:
        args.append("--dry-run=server")
    proc = cp.kubectl(*args, input=json.dumps(obj), check=check)
    return json.loads(proc.stdout) if proc.returncode == 0 else proc


def get(cp: ControlPlane, ns: str, name: str) -> Manifest:
    obj: Manifest = json.loads(cp.kubectl("get", "-n", ns, "wr", name, "-o", "json").stdout)
    return obj


@pytest.fixture(scope="module")
def ns(control_plane: ControlPlane, weightrefit_crd: str) -> str:
    return control_plane.create_namespace("crd")


def test_crd_is_established_with_names_and_status_subresource(
    control_plane: ControlPlane, weightrefit_crd: str
) -> None:
    crd = json.loads(control_plane.kubectl("get", "crd", weightrefit_crd, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema") is None
    assert crd["spec"]["names"]["shortNames"] == ["wr", "refit"]
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(spec_schema)


def test_crd_apply_is_idempotent_and_warning_free(
    control_plane: ControlPlane, weightrefit_crd: str
) -> None:
    proc = control_plane.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
    assert "unchanged" in proc.stdout or "serverside-applied" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted(control_plane: ControlPlane, ns: str, path: Path) -> None:
    proc = control_plane.kubectl(
        "apply", "-n", ns, "--server-side", "--validate=strict", "-f", str(path)
    )
    assert "Warning" not in proc.stderr, proc.stderr
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        if doc["kind"] == "WeightRefit":
            stored = get(control_plane, ns, doc["metadata"]["name"])
            if "adapter" in doc["spec"]:
                assert stored["spec"]["adapter"] == doc["spec"]["adapter"]
                continue
            assert stored["spec"]["checkpoint"] == {
                "format": "safetensors",
                **doc["spec"]["checkpoint"],
            }
        elif doc["kind"] == "ConfigMap" and PROBE_FILE in doc["data"]:
            # An example's probe reference must also be valid under the wire contract.
            ProbeReference.from_json_dict(json.loads(doc["data"][PROBE_FILE]))


def test_examples_cover_each_strategy_and_policy() -> None:
    specs = [
        d["spec"]
        for p in EXAMPLES
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "WeightRefit"
    ]
    assert {s.get("strategy", {}).get("type", "AllAtOnce") for s in specs} == {
        "AllAtOnce",
        "Rolling",
    }
    assert any(s.get("strategy", {}).get("canary", 0) > 0 for s in specs)
    assert any(s.get("onFailure") == "Rollback" for s in specs)
    assert any(s.get("probe", {}).get("reference", {}).get("source") == "ConfigMap" for s in specs)
    assert any(s.get("queuePolicy") == "LatestWins" for s in specs)
    assert any("groups" in s["fleet"] for s in specs)
    assert any("adapter" in s for s in specs)


def test_defaults_are_applied(control_plane: ControlPlane, ns: str) -> None:
    stored = create(control_plane, ns, minimal("defaults"))
    assert stored["spec"] == {
        "fleet": {"selector": {"matchLabels": {"app": "rollout"}}, "port": 8000},
        "checkpoint": {
            "path": "/checkpoints/step-1",
            "version": "step-1",
            "format": "safetensors",
        },
        "sequence": {
            "drainMode": "wait",
            "sleepLevel": 1,
            "stepTimeoutSeconds": 120,
            "drainTimeoutSeconds": 60,
            "drainDelaySeconds": 0,
            "loadTimeoutSeconds": 600,
            "probeTimeoutSeconds": 60,
            "totalTimeoutSeconds": 3600,
            "retries": 2,
        },
        "strategy": {"type": "AllAtOnce", "maxUnavailable": "25%", "canary": 0},
        "probe": {
            "reference": {"source": "Checkpoint"},
            "thresholds": {
                "meanAbsLogprobDiff": 0.05,
                "maxAbsLogprobDiff": 0.5,
                "nllDiff": 0.05,
                "podAgreement": 0.02,
                "minDraftAcceptance": 0.5,
            },
            "failureLimit": 0,
            "inconclusiveLimit": 0,
        },
        "onFailure": "Halt",
        "queuePolicy": "Queue",
        "allowUnsafeBackends": False,
    }


def test_nested_defaults_fill_partial_objects(control_plane: ControlPlane, ns: str) -> None:
    obj = minimal("partial")
    obj["spec"]["fleet"]["adminTokenSecretRef"] = {"name": "vllm-admin"}
    obj["spec"]["probe"] = {
        "reference": {"source": "ConfigMap", "configMapRef": {"name": "ref"}},
        "thresholds": {"nllDiff": 0.1},
    }
    spec = create(control_plane, ns, obj, dry_run=True)["spec"]
    assert spec["fleet"]["adminTokenSecretRef"] == {"name": "vllm-admin", "key": "token"}
    assert spec["probe"]["reference"]["configMapRef"] == {"name": "ref", "key": "refit-probe.json"}
    assert spec["probe"]["thresholds"]["nllDiff"] == 0.1
    assert spec["probe"]["thresholds"]["maxAbsLogprobDiff"] == 0.5


def _set(path: str, value: Any) -> Callable[[Manifest], None]:
    def mutate(obj: Manifest) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _drop(path: str) -> Callable[[Manifest], None]:
    def mutate(obj: Manifest) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for key in parents:
            node = node[key]
        del node[leaf]

    return mutate


CM_REF = {"name": "probe-ref"}
VERSION_RULE = "must be 1-63 letters, digits, '.', '_' or '-', starting and ending with a letter"
MAX_UNAVAILABLE_RULE = "must be an integer of at least 1 or a percentage from 1% to 100%"

# (id, mutation of a valid minimal WeightRefit, field path, message fragment)
INVALID: list[tuple[str, Callable[[Manifest], None], str, str]] = [
    ("no-spec", _drop("spec"), "spec", "Required value"),
    ("no-fleet", _drop("spec.fleet"), "spec.fleet", "Required value"),
    ("no-checkpoint-path", _drop("spec.checkpoint.path"), "spec.checkpoint.path", "Required"),
    ("relative-path", _set("spec.checkpoint.path", "ckpt/step-1"), "spec.checkpoint.path",
     "must be an absolute path"),
    ("dotdot-segment", _set("spec.checkpoint.path", "/ckpt/../etc"), "spec.checkpoint.path",
     "must not contain a '..' segment"),
    ("dotdot-at-end", _set("spec.checkpoint.path", "/ckpt/.."), "spec.checkpoint.path",
     "must not contain a '..' segment"),
    ("control-char-path", _set("spec.checkpoint.path", "/ckpt/a\nb"), "spec.checkpoint.path",
     "must not contain control characters"),
    ("version-with-space", _set("spec.checkpoint.version", "step 1"),
     "spec.checkpoint.version", VERSION_RULE),
    ("version-leading-dash", _set("spec.checkpoint.version", "-step1"),
     "spec.checkpoint.version", VERSION_RULE),
    ("version-trailing-dot", _set("spec.checkpoint.version", "step1."),
     "spec.checkpoint.version", VERSION_RULE),
    ("version-64-chars", _set("spec.checkpoint.version", "v" * 64),
     "spec.checkpoint.version", "may not be more than 63"),
    ("version-empty", _set("spec.checkpoint.version", ""), "spec.checkpoint.version",
     "at least 1 chars long"),
    ("format-unknown", _set("spec.checkpoint.format", "pytorch"), "spec.checkpoint.format",
     'Unsupported value: "pytorch"'),
    ("sleep-level-3", _set("spec.sequence.sleepLevel", 3), "spec.sequence.sleepLevel",
     "less than or equal to 2"),
    ("drain-mode-unknown", _set("spec.sequence.drainMode", "later"), "spec.sequence.drainMode",
     'Unsupported value: "later"'),
    ("groups-one-label", _set("spec.fleet.groups", {"groupLabel": "x", "indexLabel": "x"}),
     "spec.fleet.groups", "groupLabel and indexLabel must be two different labels"),
    ("step-timeout-0", _set("spec.sequence.stepTimeoutSeconds", 0),
     "spec.sequence.stepTimeoutSeconds", "greater than or equal to 1"),
    ("load-timeout-0", _set("spec.sequence.loadTimeoutSeconds", 0),
     "spec.sequence.loadTimeoutSeconds", "greater than or equal to 1"),
    ("total-timeout-negative", _set("spec.sequence.totalTimeoutSeconds", -5),
     "spec.sequence.totalTimeoutSeconds", "greater than or equal to 1"),
    ("drain-timeout-negative", _set("spec.sequence.drainTimeoutSeconds", -1),
     "spec.sequence.drainTimeoutSeconds", "greater than or equal to 1"),
    ("drain-delay-negative", _set("spec.sequence.drainDelaySeconds", -1),
     "spec.sequence.drainDelaySeconds", "greater than or equal to 0"),
    ("drain-delay-301", _set("spec.sequence.drainDelaySeconds", 301),
     "spec.sequence.drainDelaySeconds", "less than or equal to 300"),
    ("drain-delay-fraction", _set("spec.sequence.drainDelaySeconds", 1.5),
     "spec.sequence.drainDelaySeconds", "must be of type integer"),
    ("retries-11", _set("spec.sequence.retries", 11), "spec.sequence.retries",
     "less than or equal to 10"),
    ("max-unavailable-0", _set("spec.strategy.maxUnavailable", 0),
     "spec.strategy.maxUnavailable", MAX_UNAVAILABLE_RULE),
    ("max-unavailable-negative", _set("spec.strategy.maxUnavailable", -1),
     "spec.strategy.maxUnavailable", MAX_UNAVAILABLE_RULE),
    ("max-unavailable-150%", _set("spec.strategy.maxUnavailable", "150%"),
     "spec.strategy.maxUnavailable", MAX_UNAVAILABLE_RULE),
    ("max-unavailable-0%", _set("spec.strategy.maxUnavailable", "0%"),
     "spec.strategy.maxUnavailable", MAX_UNAVAILABLE_RULE),
    ("max-unavailable-abc", _set("spec.strategy.maxUnavailable", "abc"),
     "spec.strategy.maxUnavailable", MAX_UNAVAILABLE_RULE),
    ("canary-negative", _set("spec.strategy.canary", -1), "spec.strategy.canary",
     "greater than or equal to 0"),
    ("strategy-unknown", _set("spec.strategy.type", "BlueGreen"), "spec.strategy.type",
     'Unsupported value: "BlueGreen"'),
    ("selector-empty", _set("spec.fleet.selector", {}), "spec.fleet.selector",
     "must not be empty"),
    ("selector-empty-labels", _set("spec.fleet.selector", {"matchLabels": {}}),
     "spec.fleet.selector", "must not be empty"),
    ("selector-bad-label-key", _set("spec.fleet.selector.matchLabels", {"bad key": "x"}),
     "spec.fleet.selector.matchLabels", "keys must be valid label keys"),
    ("selector-bad-label-value", _set("spec.fleet.selector.matchLabels", {"app": "a b"}),
     "spec.fleet.selector.matchLabels.app", "should match"),
    ("selector-in-without-values",
     _set("spec.fleet.selector.matchExpressions", [{"key": "app", "operator": "In"}]),
     "spec.fleet.selector.matchExpressions[0]", "values must be non-empty for operator In"),
    ("port-0", _set("spec.fleet.port", 0), "spec.fleet.port", "greater than or equal to 1"),
    ("port-70000", _set("spec.fleet.port", 70000), "spec.fleet.port", "less than or equal to"),
    ("secret-name-invalid", _set("spec.fleet.adminTokenSecretRef", {"name": "Bad_Name"}),
     "spec.fleet.adminTokenSecretRef.name", "must be a valid Secret name"),
    ("configmap-source-without-ref", _set("spec.probe.reference", {"source": "ConfigMap"}),
     "spec.probe.reference", "configMapRef is required when source is ConfigMap"),
    ("checkpoint-source-with-ref", _set("spec.probe.reference.configMapRef", CM_REF),
     "spec.probe.reference", "must be omitted when source is Checkpoint"),
    ("threshold-negative", _set("spec.probe.thresholds.maxAbsLogprobDiff", -0.1),
     "spec.probe.thresholds.maxAbsLogprobDiff", "greater than or equal to 0"),
    ("failure-limit-negative", _set("spec.probe.failureLimit", -1), "spec.probe.failureLimit",
     "greater than or equal to 0"),
    ("inconclusive-limit-negative", _set("spec.probe.inconclusiveLimit", -1),
     "spec.probe.inconclusiveLimit", "greater than or equal to 0"),
    ("on-failure-unknown", _set("spec.onFailure", "Retry"), "spec.onFailure",
     'Unsupported value: "Retry"'),
    ("queue-policy-unknown", _set("spec.queuePolicy", "Newest"), "spec.queuePolicy",
     'Unsupported value: "Newest"'),
    ("on-base-refit-unknown", _set("spec.adapters.onBaseRefit", "Keep"),
     "spec.adapters.onBaseRefit", 'Unsupported value: "Keep"'),
    ("ttl-negative", _set("spec.ttlSecondsAfterFinished", -1), "spec.ttlSecondsAfterFinished",
     "greater than or equal to 0"),
    ("ttl-not-integer", _set("spec.ttlSecondsAfterFinished", "1h"),
     "spec.ttlSecondsAfterFinished", "must be of type integer"),
    ("unknown-spec-field", _set("spec.maxSurge", 1), "spec.maxSurge", "unknown field"),
    ("unknown-nested-field", _set("spec.strategy.partition", 1), "spec.strategy.partition",
     "unknown field"),
    ("wrong-type", _set("spec.sequence.sleepLevel", "one"), "spec.sequence.sleepLevel",
     "must be of type integer"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "field", "fragment"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])  # fmt: skip
def test_invalid_weightrefit_is_rejected(
    control_plane: ControlPlane,
    ns: str,
    mutate: Callable[[Manifest], None],
    field: str,
    fragment: str,
) -> None:
    obj = minimal("invalid")
    mutate(obj)
    assert field in assert_rejected(control_plane, ns, obj, fragment)


def assert_rejected(cp: ControlPlane, ns: str, obj: Manifest, fragment: str) -> str:
    """The API server refuses ``obj`` naming ``fragment``, and stores nothing; its stderr."""
    proc = create(cp, ns, obj, check=False)
    assert proc.returncode != 0, f"accepted: {json.dumps(obj.get('spec', obj))}"
    assert fragment in proc.stderr, proc.stderr
    name = obj["metadata"]["name"]
    assert cp.kubectl("get", "-n", ns, "wr", name, check=False).returncode != 0
    return str(proc.stderr)


@pytest.fixture
def stored(control_plane: ControlPlane, ns: str) -> Iterator[Manifest]:
    obj = minimal("immutable")
    obj["spec"]["fleet"]["adminTokenSecretRef"] = {"name": "admin"}
    yield create(control_plane, ns, obj)
    control_plane.kubectl("delete", "-n", ns, "wr", "immutable", "--wait=false")


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        ("spec.checkpoint.path", "/checkpoints/other", "spec.checkpoint is immutable"),
        ("spec.checkpoint.version", "other", "spec.checkpoint is immutable"),
        ("spec.fleet.selector.matchLabels", {"app": "other"}, "spec.fleet is immutable"),
        ("spec.fleet.port", 9000, "spec.fleet is immutable"),
        ("spec.fleet.adminTokenSecretRef.name", "other", "spec.fleet is immutable"),
        # The preflight admitted the pods for this sequence (sleepLevel 2 is refused where
        # it is unsafe); a pass slept at one level must not be woken by another's steps.
        ("spec.sequence.sleepLevel", 2, "spec.sequence is immutable"),
        ("spec.sequence.drainMode", "abort", "spec.sequence is immutable"),
        ("spec.sequence.retries", 5, "spec.sequence is immutable"),
    ],
)
def test_fleet_and_checkpoint_are_immutable(
    control_plane: ControlPlane, ns: str, stored: Manifest, path: str, value: Any, fragment: str
) -> None:
    changed = copy.deepcopy(stored)
    _set(path, value)(changed)
    proc = control_plane.kubectl(
        "replace", "-n", ns, "-f", "-", input=json.dumps(changed), check=False
    )
    assert proc.returncode != 0
    assert fragment in proc.stderr
    assert get(control_plane, ns, "immutable")["spec"] == stored["spec"]


def test_other_spec_fields_stay_mutable(
    control_plane: ControlPlane, ns: str, stored: Manifest
) -> None:
    patch = {"spec": {"probe": {"failureLimit": 2}, "strategy": {"type": "Rolling"}}}
    control_plane.kubectl(
        "patch", "-n", ns, "wr", "immutable", "--type=merge", "-p", json.dumps(patch)
    )
    spec = get(control_plane, ns, "immutable")["spec"]
    assert spec["probe"]["failureLimit"] == 2
    assert spec["strategy"]["type"] == "Rolling"


FULL_STATUS: Manifest = {
    "phase": "Progressing",
    "broadcast": {"round": 2, "worldSize": 3, "receivers": 2, "state": "Ready"},
    "checksums": [{"version": "step-1", "layout": "f32-3a9c", "digest": "e0535060d31ad75d"}],
    "observedGeneration": 1,
    "message": "2 of 3 pods at step-1; pod-2 is loading",
    "conditions": [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Progressing",
            "message": "refit in progress",
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "observedGeneration": 1,
        },
        {
            "type": "Progressing",
            "status": "True",
            "reason": "PodsUpdating",
            "message": "updating pod-2",
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "observedGeneration": 1,
        },
        {
            "type": "Degraded",
            "status": "False",
            "reason": "AllProbesPassed",
            "message": "",
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "observedGeneration": 1,
        },
    ],
    "targetPods": 3,
    "updatedPods": 2,
    "failedPods": 0,
    "inconclusivePods": 0,
    "previous": {"version": "step-0", "path": "/checkpoints/step-0", "refit": "wr-step-0"},
    "fleet": "app=rollout",
    "queuePosition": 0,
    "startTime": "2026-01-02T03:04:05Z",
    "completionTime": "2026-01-02T03:09:05Z",
    "probeSummary": {
        "passed": 2,
        "failed": 0,
        "inconclusive": 0,
        "worstMeanAbsLogprobDiff": 0.0125,
        "worstMaxAbsLogprobDiff": 0.25,
        "worstNllDiff": 0.0075,
        "nllSpread": 0.003,
    },
    "outOfTraffic": {"pods": 1, "worstSeconds": 13.5, "medianSeconds": 13.5, "worstPod": "pod-0"},
    "sequence": {
        "drainMode": "wait",
        "sleepLevel": 1,
        "stepTimeoutSeconds": 120,
        "drainTimeoutSeconds": 60,
        "drainDelaySeconds": 5,
        "loadTimeoutSeconds": 600,
        "probeTimeoutSeconds": 60,
        "totalTimeoutSeconds": 3600,
        "retries": 2,
    },
    "layout": "TP2 PP1 DP1",
    "pods": [
        {
            "name": "pod-0",
            "phase": "Succeeded",
            "step": "ready",
            "version": "step-1",
            "checksum": "e0535060d31ad75d",
            "reason": "",
            "message": "",
            "attempts": 1,
            "startTime": "2026-01-02T03:04:05Z",
            "completionTime": "2026-01-02T03:05:05Z",
            "stepSeconds": {"stage": 4.0, "drain": 0.5, "load": 12.25, "probe": 0.75},
            "outOfTrafficSeconds": 13.5,
            "probe": {
                "verdict": "Pass",
                "nll": 2.5,
                "referenceNll": 2.4925,
                "meanAbsLogprobDiff": 0.0125,
                "maxAbsLogprobDiff": 0.25,
                "tokens": 256,
                "draftAcceptance": 0.875,
            },
        },
        {
            "name": "pod-2",
            "phase": "Failed",
            "step": "load",
            "version": "step-0",
            "reason": "ManifestMismatch",
            "message": "tensor model.norm.weight has shape [64], manifest says [128]",
            "attempts": 3,
            "startTime": "2026-01-02T03:04:05Z",
            "completionTime": "",  # the operator writes "" until a time is known
            "stepSeconds": {},
            "probe": {"verdict": "Inconclusive", "tokens": 0},
        },
    ],
    "podsOmitted": 0,
}


def test_full_status_round_trips_through_status_subresource(
    control_plane: ControlPlane, ns: str
) -> None:
    create(control_plane, ns, minimal("status"))
    control_plane.kubectl(
        "patch", "-n", ns, "wr", "status", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": FULL_STATUS}),
    )  # fmt: skip
    assert get(control_plane, ns, "status")["status"] == FULL_STATUS


def _value_paths(value: Any, prefix: str) -> Iterator[str]:
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, dict):
            for key, sub in item.items():
                yield f"{prefix}.{key}"
                yield from _value_paths(sub, f"{prefix}.{key}")


def test_full_status_exercises_every_declared_status_field() -> None:
    declared = {path for path, _ in _schema_fields(_crd_schema()["properties"]["status"], "status")}
    used = set(_value_paths(FULL_STATUS, "status"))
    # stepSeconds keys are free-form step names, not schema fields.
    used = {p for p in used if ".stepSeconds." not in p}
    assert declared == used


def test_status_prunes_undeclared_fields_and_ignores_main_resource_writes(
    control_plane: ControlPlane, ns: str
) -> None:
    # Shows the round-trip above means something: an undeclared field does not survive.
    create(control_plane, ns, minimal("pruned"))
    status = {"phase": "Queued", "queuePosition": 2, "undeclared": "x"}
    warning = control_plane.kubectl(
        "patch", "-n", ns, "wr", "pruned", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    ).stderr  # fmt: skip
    assert 'unknown field "status.undeclared"' in warning
    assert get(control_plane, ns, "pruned")["status"] == {"phase": "Queued", "queuePosition": 2}
    control_plane.kubectl(
        "patch", "-n", ns, "wr", "pruned", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Succeeded"}}),
    )  # fmt: skip
    assert get(control_plane, ns, "pruned")["status"]["phase"] == "Queued"


def test_status_rejects_unknown_phase(control_plane: ControlPlane, ns: str) -> None:
    create(control_plane, ns, minimal("badphase"))
    proc = control_plane.kubectl(
        "patch", "-n", ns, "wr", "badphase", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Done"}}), check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert 'status.phase: Unsupported value: "Done"' in proc.stderr


def test_status_pods_is_capped_by_the_schema(control_plane: ControlPlane, ns: str) -> None:
    """status.pods holds at most api.STATUS_PODS_LIMIT entries: the API server says so too."""
    from refit_operator.core.api_status import STATUS_PODS_LIMIT

    create(control_plane, ns, minimal("capped"))

    def patch(n: int) -> Any:
        pods = [{"name": f"pod-{i}", "phase": "Failed"} for i in range(n)]
        status = {"phase": "Halted", "pods": pods, "podsOmitted": 7}
        return control_plane.kubectl(
            "patch", "-n", ns, "wr", "capped", "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": status}), check=False,
        )  # fmt: skip

    too_many = patch(STATUS_PODS_LIMIT + 1)
    assert too_many.returncode != 0 and "status.pods: Too many" in too_many.stderr
    assert patch(STATUS_PODS_LIMIT).returncode == 0
    st = get(control_plane, ns, "capped")["status"]
    assert len(st["pods"]) == STATUS_PODS_LIMIT and st["podsOmitted"] == 7


def test_printer_columns_and_short_names(control_plane: ControlPlane, ns: str) -> None:
    create(control_plane, ns, minimal("columns"))
    control_plane.kubectl(
        "patch", "-n", ns, "wr", "columns", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": FULL_STATUS}),
    )  # fmt: skip
    for short in ("wr", "refit"):
        header, row = control_plane.kubectl("get", "-n", ns, short, "columns").stdout.splitlines()
        assert header.split() == [
            "NAME", "VERSION", "PHASE", "UPDATED", "TARGET", "FAILED", "WORST-DLOGPROB", "AGE",
        ]  # fmt: skip
        assert row.split()[:7] == ["columns", "step-1", "Progressing", "2", "3", "0", "0.25"]


def _schema_fields(schema: Manifest, prefix: str) -> Iterator[tuple[str, str]]:
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{name}"
        yield path, sub.get("description", "")
        yield from _schema_fields(sub.get("items", sub), path)


def _crd_schema() -> Manifest:
    crd = yaml.safe_load((CRD_DIR / "weightrefit.yaml").read_text())
    schema: Manifest = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_every_field_has_a_description() -> None:
    schema = _crd_schema()
    missing = [
        path
        for part in ("spec", "status")
        for path, description in _schema_fields(schema["properties"][part], part)
        if not description.strip()
    ]
    assert missing == []


def test_kubectl_explain_teaches_the_spec(
    control_plane: ControlPlane, weightrefit_crd: str
) -> None:
    recursive = control_plane.kubectl("explain", "weightrefit.spec", "--recursive").stdout
    fields = list(_schema_fields(_crd_schema()["properties"]["spec"], "spec"))
    assert len(fields) > 40
    for path, description in fields:
        leaf = path.rsplit(".", 1)[1]
        assert f"\n{' ' * (2 * path.count('.'))}{leaf}\t" in recursive, path
        explained = control_plane.kubectl("explain", f"weightrefit.{path}").stdout
        # kubectl re-wraps descriptions; compare word by word.
        assert " ".join(description.split()) in " ".join(explained.split()), path


# --------------------------------------------------------------------- broadcast source
BROADCAST = {
    "version": "step-2",
    "rendezvous": {"host": "10.0.0.5", "port": 29500},
    "manifest": {"configMapRef": {"name": "step-2-weights"}, "digest": "ab" * 32},
}
CONFIGMAP_REFERENCE = {"source": "ConfigMap", "configMapRef": {"name": "step-2-weights"}}


def broadcast_refit(name: str = "bcast") -> Manifest:
    obj = minimal(name)
    del obj["spec"]["checkpoint"]
    obj["spec"]["broadcast"] = copy.deepcopy(BROADCAST)
    obj["spec"]["probe"] = {"reference": copy.deepcopy(CONFIGMAP_REFERENCE)}
    return obj


def test_a_broadcast_refit_is_accepted_with_its_defaults(
    control_plane: ControlPlane, ns: str
) -> None:
    stored = create(control_plane, ns, broadcast_refit("bcast-ok"), dry_run=True)
    b = stored["spec"]["broadcast"]
    assert (b["engine"], b["timeoutSeconds"]) == ("refit-gloo", 600)
    assert b["manifest"]["configMapRef"]["key"] == "transfer-manifest.json"
    assert "checkpoint" not in stored["spec"]


BROADCAST_INVALID = [
    ("both-sources", _set("spec.checkpoint", {"path": "/c", "version": "v"}),
     "set exactly one weight source"),
    ("no-source", _drop("spec.broadcast"), "set exactly one weight source"),
    ("checkpoint-reference", _set("spec.probe.reference", {"source": "Checkpoint"}),
     "spec.broadcast needs spec.probe.reference.source ConfigMap"),
    ("host-not-ipv4", _set("spec.broadcast.rendezvous.host", "trainer.local"),
     "spec.broadcast.rendezvous.host must be an IPv4 address"),
    ("host-ipv6", _set("spec.broadcast.rendezvous.host", "::1"),
     "spec.broadcast.rendezvous.host must be an IPv4 address"),
    ("port-zero", _set("spec.broadcast.rendezvous.port", 0),
     "should be greater than or equal to 1"),
    ("digest-short", _set("spec.broadcast.manifest.digest", "ab" * 31),
     "spec.broadcast.manifest.digest must be 64 lowercase hex"),
    ("digest-upper", _set("spec.broadcast.manifest.digest", "AB" * 32),
     "spec.broadcast.manifest.digest must be 64 lowercase hex"),
    ("unknown-engine", _set("spec.broadcast.engine", "nccl"), "Unsupported value"),
    ("bad-version", _set("spec.broadcast.version", "step 2"),
     "spec.broadcast.version must be 1-63"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "fragment"), [c[1:] for c in BROADCAST_INVALID],
                         ids=[c[0] for c in BROADCAST_INVALID])  # fmt: skip
def test_an_inconsistent_broadcast_spec_is_rejected(
    control_plane: ControlPlane, ns: str, mutate: Callable[[Manifest], None], fragment: str
) -> None:
    obj = broadcast_refit("bcast-invalid")
    mutate(obj)
    assert_rejected(control_plane, ns, obj, fragment)


def test_the_weight_source_cannot_be_switched(control_plane: ControlPlane, ns: str) -> None:
    stored = create(control_plane, ns, broadcast_refit("bcast-switch"))
    try:
        changed = copy.deepcopy(stored)
        del changed["spec"]["broadcast"]
        changed["spec"]["checkpoint"] = {"path": "/checkpoints/step-2", "version": "step-2"}
        changed["spec"]["probe"]["reference"] = {"source": "Checkpoint"}
        proc = control_plane.kubectl(
            "replace", "-n", ns, "-f", "-", input=json.dumps(changed), check=False
        )
        assert proc.returncode != 0
        assert "the weight source" in proc.stderr, proc.stderr
        again = copy.deepcopy(stored)
        again["spec"]["broadcast"]["version"] = "other"
        proc = control_plane.kubectl(
            "replace", "-n", ns, "-f", "-", input=json.dumps(again), check=False
        )
        assert "spec.broadcast is immutable" in proc.stderr, proc.stderr
        assert get(control_plane, ns, "bcast-switch")["spec"] == stored["spec"]
    finally:
        control_plane.kubectl("delete", "-n", ns, "wr", "bcast-switch", "--wait=false")


# ----------------------------------------------------------------------- adapter source
ADAPTER = {"name": "policy", "path": "/checkpoints/lora/step-2", "version": "step-2"}


def adapter_refit(name: str = "lora") -> Manifest:
    obj = minimal(name)
    del obj["spec"]["checkpoint"]
    obj["spec"]["adapter"] = copy.deepcopy(ADAPTER)
    return obj


def test_an_adapter_refit_is_accepted_and_shown(control_plane: ControlPlane, ns: str) -> None:
    stored = create(control_plane, ns, adapter_refit("lora-ok"))
    try:
        assert stored["spec"]["adapter"] == ADAPTER and "checkpoint" not in stored["spec"]
        wide = control_plane.kubectl("get", "-n", ns, "wr", "lora-ok", "-o", "wide").stdout
        header, row = wide.splitlines()[:2]
        assert "ADAPTER" in header and "ADAPTER-VERSION" in header
        at = header.index("ADAPTER ")  # empty columns: read the row by the header's offsets
        assert row[at:].split()[:2] == ["policy", "step-2"]
    finally:
        control_plane.kubectl("delete", "-n", ns, "wr", "lora-ok", "--wait=false")


ADAPTER_INVALID = [
    ("with-checkpoint", _set("spec.checkpoint", {"path": "/c", "version": "v"}),
     "set exactly one weight source"),
    ("with-broadcast", _set("spec.broadcast", copy.deepcopy(BROADCAST)),
     "set exactly one weight source"),
    ("no-version", _drop("spec.adapter.version"), "Required value"),
    ("no-name", _drop("spec.adapter.name"), "Required value"),
    ("relative-path", _set("spec.adapter.path", "lora/s2"), "spec.adapter.path must be an"),
    ("dotdot", _set("spec.adapter.path", "/lora/../etc"), "must not contain a '..' segment"),
    ("name-with-slash", _set("spec.adapter.name", "team/policy"), "spec.adapter.name must be 1-40"),
    ("name-41-chars", _set("spec.adapter.name", "a" * 41), "may not be more than 40"),
    # the staged-name pattern (<name>@<version>) has a message of its own
    ("name-staged", _set("spec.adapter.name", "policy@s2"), "must not contain '@'"),
    ("bad-version", _set("spec.adapter.version", "step 2"), "spec.adapter.version must be 1-63"),
    # what a base refit does with held adapters: not a field of an adapter refit
    ("with-adapters", _set("spec.adapters", {"onBaseRefit": "Unload"}),
     "spec.adapters applies to a refit of the base weights"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "fragment"), [c[1:] for c in ADAPTER_INVALID],
                         ids=[c[0] for c in ADAPTER_INVALID])  # fmt: skip
def test_an_inconsistent_adapter_spec_is_rejected(
    control_plane: ControlPlane, ns: str, mutate: Callable[[Manifest], None], fragment: str
) -> None:
    obj = adapter_refit("lora-invalid")
    mutate(obj)
    assert_rejected(control_plane, ns, obj, fragment)


def test_an_adapter_refit_cannot_become_another_source_or_adapter(
    control_plane: ControlPlane, ns: str
) -> None:
    stored = create(control_plane, ns, adapter_refit("lora-switch"))
    try:
        changed = copy.deepcopy(stored)
        del changed["spec"]["adapter"]
        changed["spec"]["checkpoint"] = {"path": "/checkpoints/step-2", "version": "step-2"}
        proc = control_plane.kubectl(
            "replace", "-n", ns, "-f", "-", input=json.dumps(changed), check=False
        )
        assert proc.returncode != 0 and "the weight source" in proc.stderr, proc.stderr
        again = copy.deepcopy(stored)
        again["spec"]["adapter"]["name"] = "critic"
        proc = control_plane.kubectl(
            "replace", "-n", ns, "-f", "-", input=json.dumps(again), check=False
        )
        assert "spec.adapter is immutable" in proc.stderr, proc.stderr
        assert get(control_plane, ns, "lora-switch")["spec"] == stored["spec"]
    finally:
        control_plane.kubectl("delete", "-n", ns, "wr", "lora-switch", "--wait=false")
