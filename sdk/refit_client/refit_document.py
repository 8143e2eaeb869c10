"""The WeightRefit document a trainer submits, built and checked without a cluster: its
name from the version, its fleet selector from labels or a selector string, its spec from
what the caller set, and the creation stamp taken just before it is sent."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from refit_operator.core import api, times
from refit_worker.contract import API_GROUP

from .refit_error import RefitError

API_VERSION = f"{API_GROUP}/{api.VERSION}"
_NAME_MAX = 63
_SELECTOR_TERM = re.compile(r"^\s*([A-Za-z0-9][-A-Za-z0-9_./]*)\s*(==|=)\s*([-A-Za-z0-9_.]*)\s*$")


def parse_selector(selector: Mapping[str, str] | str | api.LabelSelector) -> api.LabelSelector:
    """A fleet selector from a dict of labels, an equality selector string ("app=x,pool=y")
    or a LabelSelector. Set-based expressions need a LabelSelector (no string parser here)."""
    if isinstance(selector, api.LabelSelector):
        sel = selector
    elif isinstance(selector, str):
        labels = {}
        for term in filter(None, (t.strip() for t in selector.split(","))):
            m = _SELECTOR_TERM.match(term)
            if m is None:
                raise RefitError(
                    f"fleet_selector term {term!r} is not key=value; pass a LabelSelector "
                    "for set-based expressions"
                )
            labels[m.group(1)] = m.group(3)
        sel = api.LabelSelector(match_labels=labels)
    else:
        sel = api.LabelSelector(match_labels=dict(selector))
    if not sel.match_labels and not sel.match_expressions:
        raise RefitError("fleet_selector must not be empty: it would select every pod")
    return sel


def default_name(version: str) -> str:
    """A DNS-1123 name from the version: refit-<version>, lowercased, cut to 63 characters."""
    slug = re.sub(r"[^a-z0-9-]+", "-", version.lower()).strip("-")
    return f"refit-{slug}"[:_NAME_MAX].rstrip("-")


def build_refit(
    name: str,
    checkpoint_path: str,
    version: str,
    *,
    fleet_selector: Mapping[str, str] | str | api.LabelSelector,
    port: int | None = None,
    admin_token_secret: str | None = None,
    strategy: str | None = None,
    max_unavailable: int | str | None = None,
    canary: int | None = None,
    on_failure: str | None = None,
    queue_policy: str | None = None,
    thresholds: Mapping[str, float] | None = None,
    failure_limit: int | None = None,
    sequence: Mapping[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
    broadcast: Mapping[str, Any] | None = None,
    adapter: str | None = None,
    probe_reference_config_map: str | None = None,
    spec_fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The WeightRefit document. Only what the caller set goes into the spec: the API server
    fills in the defaults, so the stored object says which choices were made on purpose.
    The spec is checked against the operator's own model first, so a typo fails here, with
    the field named, before anything reaches the cluster.

    spec_fields: further spec fields as the API spells them, for those no keyword sets
    ({"ttlSecondsAfterFinished": 0}, {"fleet": {"apiKeySecretRef": ...}}): a mapping merges
    into the one the keywords made, any other value sets the field.
    adapter: the LoRA adapter's name; ``checkpoint_path`` is then the adapter directory and
    the refit spec.adapter (docs/concepts.md, "LoRA adapters")."""
    fleet: dict[str, Any] = {"selector": parse_selector(fleet_selector).dump()}
    if port is not None:
        fleet["port"] = port
    if admin_token_secret is not None:
        fleet["adminTokenSecretRef"] = {"name": admin_token_secret}
    spec: dict[str, Any] = {"fleet": fleet}
    if broadcast is not None:  # spec.broadcast instead of a checkpoint (docs/broadcast.md)
        spec["broadcast"] = {"version": version, **broadcast}
    elif adapter is not None:
        spec["adapter"] = {"name": adapter, "path": checkpoint_path, "version": version}
    else:
        spec["checkpoint"] = {"path": checkpoint_path, "version": version}
    strat = {
        k: v
        for k, v in (("type", strategy), ("maxUnavailable", max_unavailable), ("canary", canary))
        if v is not None
    }
    if strat:
        spec["strategy"] = strat
    probe: dict[str, Any] = {}
    if thresholds:
        probe["thresholds"] = dict(thresholds)
    if failure_limit is not None:
        probe["failureLimit"] = failure_limit
    if probe_reference_config_map is not None:
        probe["reference"] = {
            "source": "ConfigMap",
            "configMapRef": {"name": probe_reference_config_map},
        }
    if probe:
        spec["probe"] = probe
    if sequence:
        spec["sequence"] = dict(sequence)
    if on_failure is not None:
        spec["onFailure"] = on_failure
    if queue_policy is not None:
        spec["queuePolicy"] = queue_policy
    for field, value in (spec_fields or {}).items():
        made = spec.get(field)
        if isinstance(made, Mapping) and isinstance(value, Mapping):
            value = {**made, **value}
        spec[field] = value
    try:
        api.WeightRefitSpec.model_validate(spec)
    except ValidationError as e:
        raise RefitError(f"invalid WeightRefit spec: {e}") from e
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = dict(labels)
    return {"apiVersion": API_VERSION, "kind": api.KIND, "metadata": meta, "spec": spec}


def stamped(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with its creation stamp (times.CREATED_ANNOTATION), taken just before it is
    sent: refits a trainer creates within one second of each other keep the order it created
    them in, whatever their names (docs/concepts.md, "Which refit is newer")."""
    annotations = body.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[times.CREATED_ANNOTATION] = times.stamp(time.time_ns())
    return body
