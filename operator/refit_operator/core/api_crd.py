"""What the WeightRefit CRD says beyond the models' types: the CEL rules and schema keywords
api.py's fields and models carry (``crd``, ``crd_model``), the rules several fields share, and
the document's names, scope and printer columns.

api.py's models are the single source of the API. hack/gen_crd.py turns their JSON schema
(types, enums, defaults, required fields, ge/le bounds, the field docstrings as descriptions)
and what this module adds into crds/weightrefit.yaml; `make generate` writes it and
tests/unit/test_generated.py fails when the committed file differs. What only the API server
checks (lengths, patterns, CEL) is written with ``crd`` so the models' own validation is not
changed by it.

CEL rules bound every string and list they touch (maxLength/maxItems) so that their estimated
cost fits the API server's budget.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import ConfigDict, Field

# The JSON-schema key that carries what ``crd`` adds; hack/gen_crd.py reads and removes it.
CRD_KEY: Final = "x-refit-crd"
# A rule's message may say this: the generator writes the path of the field the rule is on
# (spec.fleet.adminTokenSecretRef.name), so one model's rules name each place it is used.
PATH: Final = "{path}"


def rule(cel: str, message: str) -> dict[str, str]:
    """One x-kubernetes-validations entry: a CEL rule and the message the API server answers
    with when it is false."""
    return {"rule": cel, "message": message}


def _extra(
    rules: tuple[dict[str, str], ...],
    list_map_keys: list[str] | None,
    record_of: str | None,
    schema: dict[str, Any],
) -> dict[str, Any]:
    out = dict(schema)
    if rules:
        out["x-kubernetes-validations"] = list(rules)
    if list_map_keys:
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = list_map_keys
    if record_of:
        out["x-refit-record-of"] = record_of
    return {CRD_KEY: out}


def crd(
    *rules: dict[str, str],
    list_map_keys: list[str] | None = None,
    record_of: str | None = None,
    **schema: Any,
) -> Any:
    """A field's CRD-only schema, for ``Annotated[type, crd(...)]``: CEL rules (``rule``) and
    schema keywords in the CRD's own spelling (maxLength=63, pattern=..., format="int32").
    They are merged into what the type makes, after its model is inlined: a nested dict merges
    (``items={"maxLength": 63}``, ``properties={"key": {"description": ...}}``), None removes
    a keyword. ``list_map_keys`` makes a list a map keyed by those fields (server-side apply
    merges its entries). ``record_of="spec.sequence"``: a status field recording that spec
    field as admitted, listed by type only, each field described "As spec.sequence.<field>."
    (no defaults, enums or bounds: the operator writes it from a spec the server admitted)."""
    return Field(json_schema_extra=_extra(rules, list_map_keys, record_of, schema))


def crd_model(*rules: dict[str, str], **schema: Any) -> ConfigDict:
    """A model's CRD-only schema, for ``model_config = crd_model(...)``: its object's CEL rules
    (on ``self``, the whole object) and schema keywords, as ``crd``; ``required=[...]`` replaces
    the required fields the model's types make."""
    return ConfigDict(json_schema_extra=_extra(rules, None, None, schema))


# ---------------------------------------------------------------- rules fields share
# A label value (Kubernetes' own pattern): at most 63 characters.
LABEL_VALUE: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_KEY_RULE: Final = rule(
    r"self.all(k, size(k) <= 317 && k.matches(r'^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]"
    r"([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$'))",
    f"{PATH} keys must be valid label keys ([prefix/]name, name at most 63 characters)",
)
# metav1.Condition's type: an optional DNS-subdomain prefix, then a label-value-like name.
CONDITION_TYPE: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# A weight version or adapter name: it is used as a label value and in file names.
VERSION_CEL: Final = r"self.matches(r'^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$')"
VERSION_RULE: Final = rule(
    VERSION_CEL,
    f"{PATH} must be 1-63 letters, digits, '.', '_' or '-', starting and ending with a letter"
    " or digit",
)
# An absolute path inside the pods; the worker also holds it under REFIT_ALLOWED_ROOT.
PATH_RULES: Final = (
    rule("self.startsWith('/')", f"{PATH} must be an absolute path (start with '/')"),
    rule(r"!self.matches(r'(^|/)\.\.(/|$)')", f"{PATH} must not contain a '..' segment"),
    rule(r"!self.matches(r'[\x00-\x1f\x7f]')", f"{PATH} must not contain control characters"),
)


def immutable(then: str, why: str = "") -> Any:
    """``crd`` for a field the API server keeps as it was created (``then``: what to do
    instead, e.g. "to load another checkpoint")."""
    return crd(
        rule(
            "self == oldSelf",
            f"{PATH} is immutable after creation{why}; create a new WeightRefit {then}",
        )
    )


def object_name_rule(kind: str) -> dict[str, str]:
    """A Secret's or ConfigMap's name: a DNS subdomain."""
    return rule(
        r"self.matches(r'^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",
        f"{PATH} must be a valid {kind} name (lowercase letters, digits, '-' and '.')",
    )


def object_key_rule(kind: str) -> dict[str, str]:
    """A key within a Secret or ConfigMap."""
    return rule(
        r"self.matches(r'^[-._a-zA-Z0-9]+$')",
        f"{PATH} must be a valid {kind} key (letters, digits, '-', '_' and '.')",
    )


# ------------------------------------------------------------------------ the document
SCOPE: Final = "Namespaced"
SHORT_NAMES: Final = ("wr", "refit")
CATEGORIES: Final = ("refit",)


def _column(
    name: str, type_: str, json_path: str, description: str = "", priority: int = 0
) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "type": type_}
    if priority:
        out["priority"] = priority
    if description:
        out["description"] = description
    out["jsonPath"] = json_path
    return out


# `kubectl get weightrefits`: priority 1 columns show with -o wide only.
PRINTER_COLUMNS: Final = (
    _column("Version", "string", ".spec.checkpoint.version",
            "Weight version of the checkpoint the fleet is being refitted to (empty for a"
            " broadcast or an adapter refit)."),
    _column("Broadcast", "string", ".spec.broadcast.version",
            "Weight version the trainer broadcasts (empty for a checkpoint refit).", 1),
    _column("Adapter", "string", ".spec.adapter.name",
            "The LoRA adapter an adapter refit replaces (empty for the base weights).", 1),
    _column("Adapter-Version", "string", ".spec.adapter.version",
            "The adapter version an adapter refit brings the pods to.", 1),
    _column("Phase", "string", ".status.phase", "Where the refit stands."),
    _column("Updated", "integer", ".status.updatedPods",
            "Pods at the target version whose probe passed."),
    _column("Target", "integer", ".status.targetPods", "Pods of the fleet this refit covers."),
    _column("Failed", "integer", ".status.failedPods", "Pods whose refit or probe failed."),
    _column("Worst-Dlogprob", "number", ".status.probeSummary.worstMaxAbsLogprobDiff",
            "Worst single-token |logprob difference| against the reference, over all probed"
            " pods."),
    _column("Worst-Out-Of-Traffic", "number", ".status.outOfTraffic.worstSeconds",
            "The longest time, in seconds, a pod of this refit spent out of traffic before it"
            " was put back.", 1),
    _column("Fleet", "string", ".status.fleet", "The fleet's canonical label selector.", 1),
    _column("Message", "string", ".status.message", "One sentence about the current state.", 1),
    _column("Age", "date", ".metadata.creationTimestamp"),
)  # fmt: skip
