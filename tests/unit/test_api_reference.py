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
