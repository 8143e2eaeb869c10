"""hack/gen_crd.py: the CRD it makes of core/api.py's models is a structural schema the API
server accepts, defaults an object as the models do, and keeps every field the operator
writes. (That the committed crds/weightrefit.yaml is what it makes: test_generated.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict
from refit_operator.core import api
from refit_operator.core.api_crd import crd, rule

from hack import gen_crd

SCHEMA = gen_crd.schema()
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]


def nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from nodes(child, f"{path}.{name}" if path else name)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from nodes(node[key], f"{path}[]")


def test_the_schema_is_structural() -> None:
    """What Kubernetes refuses or prunes in a CRD's schema never reaches it: every node says
    its type (or int-or-string), nothing is a reference, a union or a null."""
    for path, node in nodes(SCHEMA):
        assert not {"$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "const"} & set(node)
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert node.get("default", "") is not None, path
        for check in node.get("x-kubernetes-validations", []):
            assert list(check) == ["rule", "message"], path
            assert "{path}" not in check["message"], path


def test_every_field_says_what_it_means() -> None:
    """`kubectl explain` documents every field: each has its docstring as description."""
    missing = [
        p for p, n in nodes(SCHEMA) if p and not p.endswith("[]") and not n.get("description")
    ]
    assert missing == ["metadata"]


def test_a_rule_on_a_shared_model_names_the_field_it_is_on() -> None:
    fleet = SPEC["properties"]["fleet"]["properties"]
    for ref in ("adminTokenSecretRef", "apiKeySecretRef"):
        (check,) = fleet[ref]["properties"]["name"]["x-kubernetes-validations"]
        assert check["message"].startswith(f"spec.fleet.{ref}.name must be a valid Secret name")
    key = fleet["apiKeySecretRef"]["properties"]["key"]
    assert key["description"] == "Key within the Secret whose value is the API key."
    assert fleet["adminTokenSecretRef"]["properties"]["key"]["description"].endswith("the token.")


def _default(doc: Any, node: dict[str, Any]) -> Any:
    """What the API server's defaulting makes of ``doc`` under ``node``."""
    if isinstance(doc, dict) and "properties" in node:
        out = dict(doc)
        for name, child in node["properties"].items():
            if name not in out and "default" in child:
                out[name] = child["default"]
            if name in out:
                out[name] = _default(out[name], child)
        return out
    if isinstance(doc, list) and "items" in node:
        return [_default(x, node["items"]) for x in doc]
    return doc


def _set(doc: Any) -> Any:
    """``doc`` without its empty lists and maps (the models' default for a list or map the
    object leaves out; the server leaves it out)."""
    if isinstance(doc, dict):
        return {k: _set(v) for k, v in doc.items() if v not in ({}, [])}
    return doc


def test_the_servers_defaults_are_the_models() -> None:
    """A WeightRefit defaulted by the API server reads as the models default it: every field
    the user leaves out, objects (``default: {}``) and their fields alike."""
    given = {
        "fleet": {"selector": {"matchLabels": {"app": "x"}},
                  "adminTokenSecretRef": {"name": "s"}, "groups": {}},
        "broadcast": {"version": "v", "rendezvous": {"host": "10.0.0.1", "port": 1},
                      "manifest": {"configMapRef": {"name": "m"}, "digest": "0" * 64}},
        "probe": {"reference": {"source": "ConfigMap", "configMapRef": {"name": "c"}}},
    }  # fmt: skip
    served = _default(given, SPEC)
    assert served == _set(api.WeightRefitSpec.model_validate(given).dump())
    assert set(served) >= {"sequence", "strategy", "probe", "onFailure", "queuePolicy"}
    assert served["sequence"]["sleepLevel"] == 1
    assert served["strategy"]["maxUnavailable"] == "25%"
    assert served["fleet"]["groups"]["indexLabel"] == api.LWS_INDEX_LABEL


def _prune(doc: Any, node: dict[str, Any]) -> Any:
    """What the API server keeps of ``doc`` (it drops every field its schema does not list)."""
    if isinstance(doc, dict) and "properties" in node:
        props = node["properties"]
        return {k: _prune(v, props[k]) for k, v in doc.items() if k in props}
    if isinstance(doc, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _prune(v, node["additionalProperties"]) for k, v in doc.items()}
    if isinstance(doc, list) and "items" in node:
        return [_prune(x, node["items"]) for x in doc]
    return doc


def test_the_server_keeps_every_status_field_the_operator_writes() -> None:
    status = api.WeightRefitStatus(
        previous=api.Previous(version="v", path="/p", refit="r"),
        pods=[api.PodResult(name="p", probe=api.PodProbe(verdict="Pass", draft_acceptance=0.9),
                            step_seconds={"load": 1.5}, out_of_traffic_seconds=1.5)],
        conditions=[api.Condition(type="Ready", status="True", reason="R")],
        checksums=[api.VersionChecksum(version="v", layout="l", digest="d")],
        broadcast=api.BroadcastRound(round=1, world_size=3, receivers=2),
        sequence=api.Sequence(drain_delay_seconds=5),
        layout="TP1 PP1 DP1",
    ).dump()  # fmt: skip
    assert _prune(status, STATUS) == status
    assert set(STATUS["properties"]["sequence"]["properties"]) == set(api.Sequence().dump())
    assert "default" not in str(STATUS)


def test_status_sequence_records_the_spec_sequence_by_type_only() -> None:
    recorded = STATUS["properties"]["sequence"]["properties"]
    assert recorded["drainMode"] == {"type": "string", "description": "As spec.sequence.drainMode."}
    assert "x-kubernetes-validations" not in STATUS["properties"]["sequence"]
    spec_level = SPEC["properties"]["sequence"]["properties"]["sleepLevel"]
    assert "enum" not in spec_level and (spec_level["minimum"], spec_level["maximum"]) == (0, 2)


def test_crd_merges_into_the_type_and_a_field_without_a_docstring_is_refused() -> None:
    class Inner(BaseModel):
        """An inner object."""

        model_config = ConfigDict(use_attribute_docstrings=True)

        n: Annotated[int, crd(rule("self > 0", "{path} must be positive"), maximum=9)] = 1
        """A number."""

    class Outer(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        inner: Annotated[Inner | None, crd(properties={"n": {"maximum": None}})] = None
        """The inner object."""
        items: list[Inner] = []
        """Inners."""

    schema = gen_crd.schema(Outer)
    inner = schema["properties"]["inner"]
    assert inner["description"] == "The inner object."  # the field's, over the class's
    assert inner["properties"]["n"] == {
        "type": "integer", "description": "A number.", "default": 1,
        "x-kubernetes-validations": [{"rule": "self > 0", "message": "inner.n must be positive"}],
    }  # fmt: skip
    assert schema["properties"]["items"]["items"]["properties"]["n"]["maximum"] == 9
    assert schema["properties"]["items"]["items"]["description"] == "An inner object."

    class Undocumented(BaseModel):
        x: int = 0

    class Top(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        spec: Undocumented
        """Documented."""

    with pytest.raises(gen_crd.CrdError, match=r"spec\.x has no description"):
        gen_crd.schema(Top)


def test_render_is_the_document_in_yaml() -> None:
    text = gen_crd.render()
    assert text.startswith("# Generated by hack/gen_crd.py")
    doc = yaml.safe_load(text)
    assert doc == gen_crd.document()
    assert doc["metadata"]["name"] == f"{api.PLURAL}.refit.rollout.dev"
    assert [c["name"] for c in doc["spec"]["versions"][0]["additionalPrinterColumns"]][:2] == [
        "Version", "Broadcast",
    ]  # fmt: skip
