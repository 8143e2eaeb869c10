"""api.py mirrors crds/weightrefit.yaml: same spec defaults, same status fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from refit_operator.core import api

CRD = Path(__file__).resolve().parents[2] / "crds" / "weightrefit.yaml"


def schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    version = next(v for v in doc["spec"]["versions"] if v["name"] == api.VERSION)
    props: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]
    return props


def crd_defaults(node: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Every leaf default the CRD declares, by dotted camelCase path."""
    out = {}
    if "default" in node and node.get("type") != "object":
        out[path] = node["default"]
    for name, child in (node.get("properties") or {}).items():
        out.update(crd_defaults(child, f"{path}.{name}" if path else name))
    return out


def model_value(model: api.WeightRefitSpec, path: str) -> Any:
    value: Any = model.dump()
    for part in path.split("."):
        value = value[part]
    return value


def minimal_spec() -> api.WeightRefitSpec:
    return api.WeightRefitSpec.model_validate(
        {
            "fleet": {"selector": {"matchLabels": {"app": "x"}}},
            "checkpoint": {"path": "/c", "version": "v"},
            "probe": {"reference": {}, "thresholds": {}},
        }
    )


def test_spec_defaults_match_the_crd():
    defaults = crd_defaults(schema()["spec"])
    # Defaults on optional objects (the Secret refs' key, configMapRef.key) apply only
    # when the object is given; they are compared below.
    nested_optional = {
        k
        for k in defaults
        if ".adminTokenSecretRef." in f".{k}"
        or ".apiKeySecretRef." in f".{k}"
        or "configMapRef" in k
        or k.startswith(("broadcast.", "fleet.groups."))
    }
    assert len(defaults) - len(nested_optional) >= 15
    spec = minimal_spec()
    for path, default in defaults.items():
        if path in nested_optional:
            continue
        assert model_value(spec, path) == default, path
    assert api.SecretKeyRef(name="s").key == defaults["fleet.adminTokenSecretRef.key"]
    assert api.SecretKeyRef(name="s").key == defaults["fleet.apiKeySecretRef.key"]
    assert api.ConfigMapKeyRef(name="c").key == defaults["probe.reference.configMapRef.key"]
    broadcast = api.Broadcast.model_validate(
        {"version": "v", "rendezvous": {"host": "10.0.0.1", "port": 1},
         "manifest": {"configMapRef": {"name": "m"}, "digest": "0" * 64}}
    )  # fmt: skip
    assert broadcast.engine == defaults["broadcast.engine"]
    assert broadcast.timeout_seconds == defaults["broadcast.timeoutSeconds"]
    assert broadcast.manifest.config_map_ref.key == defaults["broadcast.manifest.configMapRef.key"]
    groups = api.Groups()
    assert groups.group_label == defaults["fleet.groups.groupLabel"]
    assert groups.index_label == defaults["fleet.groups.indexLabel"]


def test_every_status_field_is_declared_in_the_crd():
    declared = schema()["status"]["properties"]
    status: dict[str, Any] = api.WeightRefitStatus(
        previous=api.Previous(),
        pods=[
            api.PodResult(name="p", probe=api.PodProbe(verdict="Pass"), out_of_traffic_seconds=1.5)
        ],
        conditions=[api.Condition(type="Ready", status="True", reason="R")],
        broadcast=api.BroadcastRound(round=1, world_size=3, receivers=2),
        sequence=api.Sequence(),
    ).dump()
    assert set(status["broadcast"]) == set(declared["broadcast"]["properties"])
    # Every field of the sequence the passes run: one the CRD does not declare is pruned by
    # the API server, and the passes would run its default instead.
    assert set(status["sequence"]) == set(declared["sequence"]["properties"])
    for key in status:
        assert key in declared, key
    pod_fields = declared["pods"]["items"]["properties"]
    assert set(status["pods"][0]) <= set(pod_fields)
    assert set(status["pods"][0]["probe"]) <= set(pod_fields["probe"]["properties"])
    assert set(status["probeSummary"]) <= set(declared["probeSummary"]["properties"])
    assert set(status["previous"]) <= set(declared["previous"]["properties"])
    assert set(status["outOfTraffic"]) == set(declared["outOfTraffic"]["properties"])
    assert status["pods"][0]["outOfTrafficSeconds"] == 1.5


def test_out_of_traffic_is_camel_case_and_a_pod_still_out_has_no_figure():
    st = api.WeightRefitStatus.model_validate(
        {"outOfTraffic": {"pods": 2, "worstSeconds": 9.5, "medianSeconds": 7.0,
                          "worstPod": "b"}, "pods": [{"name": "a"}]}
    )  # fmt: skip
    assert st.out_of_traffic == api.OutOfTrafficSummary(
        pods=2, worst_seconds=9.5, median_seconds=7.0, worst_pod="b"
    )
    doc: dict[str, Any] = st.dump()
    assert doc["outOfTraffic"]["worstPod"] == "b"
    assert "outOfTrafficSeconds" not in doc["pods"][0]  # None: left out, not written as null
    empty: dict[str, Any] = api.WeightRefitStatus().dump()
    assert empty["outOfTraffic"]["pods"] == 0


def test_spec_sequence_fields_match_the_crd():
    declared = schema()["spec"]["properties"]["sequence"]["properties"]
    assert set(api.Sequence().dump()) == set(declared)
    # The bounds the model refuses outside are the CRD's.
    delay = declared["drainDelaySeconds"]
    assert (delay["minimum"], delay["maximum"]) == (0, api.DRAIN_DELAY_MAX_SECONDS)


@pytest.mark.parametrize("value", [0, 1, 30, 300])
def test_drain_delay_seconds_accepted(value):
    seq = api.Sequence.model_validate({"drainDelaySeconds": value})
    assert seq.drain_delay_seconds == value
    assert seq.dump()["drainDelaySeconds"] == value


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (-1, "greater than or equal to 0"),
        (301, "less than or equal to 300"),
        (1.5, "valid integer"),
        (2.0, "valid integer"),
        ("5", "valid integer"),
        (True, "valid integer"),
        (None, "valid integer"),
    ],
)
def test_drain_delay_seconds_refused(value, says):
    with pytest.raises(ValidationError) as refused:
        api.Sequence.model_validate({"drainDelaySeconds": value})
    (error,) = refused.value.errors()
    assert error["loc"] == ("drainDelaySeconds",)
    assert says in error["msg"]
    assert "drainDelaySeconds" in str(refused.value)


def test_phases_match_the_crd_enum():
    declared = schema()["status"]["properties"]["phase"].get("enum")
    assert declared is not None and set(declared) == set(api.Phase.__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "total", "want"),
    [(1, 10, 1), (3, 10, 3), ("25%", 10, 2), ("100%", 4, 4), ("1%", 10, 1), (50, 4, 4)],
)
def test_max_unavailable(value, total, want):
    assert api.max_unavailable_count(value, total) == want


def test_selector_canonical_is_order_independent():
    a = api.LabelSelector.model_validate(
        {"matchLabels": {"b": "2", "a": "1"},
         "matchExpressions": [{"key": "t", "operator": "In", "values": ["y", "x"]}]}
    )  # fmt: skip
    assert a.canonical() == "a=1,b=2,t in (x,y)"


def test_label_selector_matches_like_kubernetes():
    from refit_operator.core.api import LabelSelector

    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "rollout"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gen", "eval"]},
                {"key": "zone", "operator": "NotIn", "values": ["b"]},
                {"key": "gpu", "operator": "Exists"},
                {"key": "draining", "operator": "DoesNotExist"},
            ],
        }
    )
    ok = {"app": "rollout", "tier": "gen", "gpu": "h200"}
    assert sel.matches(ok)
    assert sel.matches({**ok, "zone": "a"})
    assert not sel.matches({**ok, "zone": "b"})
    assert not sel.matches({**ok, "app": "other"})
    assert not sel.matches({**ok, "tier": "train"})
    assert not sel.matches({k: v for k, v in ok.items() if k != "gpu"})
    assert not sel.matches({**ok, "draining": ""})
    assert LabelSelector().matches({}) and LabelSelector().matches({"any": "thing"})
