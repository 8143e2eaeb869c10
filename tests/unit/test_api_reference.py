"""docs/api-reference.md documents every field of the CRD (tests/unit/test_generated.py
checks that it is current)."""

from __future__ import annotations

import yaml

from hack import gen_api_reference as gen


def test_every_schema_field_is_documented():
    crd = yaml.safe_load(gen.CRD.read_text())
    text = gen.OUT.read_text()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for path, node in gen._objects(top, schema["properties"][top]):
            assert f"### `{path}`" in text
            for name in node["properties"]:
                assert f"| `{name}`" in text, f"{path}.{name}"


def test_the_rules_of_spec_and_status_themselves_are_documented():
    """A nested object's rules are in its row; spec's own (one weight source) have no row."""
    crd = yaml.safe_load(gen.CRD.read_text())
    text = gen.OUT.read_text()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    messages = [
        gen._cell(rule["message"])
        for top in ("spec", "status")
        for rule in schema["properties"][top].get("x-kubernetes-validations") or []
    ]
    assert any("exactly one weight source" in m for m in messages)
    for message in messages:
        assert message in text, message
