"""The WeightRefit document a trainer submits, built without a cluster: only what was asked,
checked before it is sent; its selector and its name."""

from __future__ import annotations

import pytest
from refit_client.refit_document import build_refit, default_name, parse_selector
from refit_client.refit_error import RefitError
from refit_operator.core import api_spec


def test_build_refit_sets_only_what_was_asked():
    doc = build_refit(
        "refit-step-1", "/ckpt/step-1", "step-1", fleet_selector={"app": "rollout"},
        strategy="Rolling", canary=1, on_failure="Rollback", port=8001,
    )  # fmt: skip
    assert doc["apiVersion"] == "refit.rollout.dev/v1alpha1" and doc["kind"] == "WeightRefit"
    assert doc["metadata"] == {"name": "refit-step-1"}
    assert doc["spec"] == {
        "fleet": {"selector": {"matchLabels": {"app": "rollout"}, "matchExpressions": []},
                  "port": 8001},
        "checkpoint": {"path": "/ckpt/step-1", "version": "step-1"},
        "strategy": {"type": "Rolling", "canary": 1},
        "onFailure": "Rollback",
    }  # fmt: skip


def test_build_refit_rejects_a_bad_field_before_the_cluster_sees_it():
    with pytest.raises(RefitError, match=r"strategy\.type"):
        build_refit("x", "/c", "v", fleet_selector="app=a", strategy="Sideways")
    with pytest.raises(RefitError, match=r"onFailure|on_failure"):
        build_refit("x", "/c", "v", fleet_selector="app=a", on_failure="Panic")


def test_parse_selector_forms():
    assert parse_selector("app=rollout, pool==eval").match_labels == {
        "app": "rollout",
        "pool": "eval",
    }
    assert parse_selector({"a": "b"}).canonical() == "a=b"
    sel = api_spec.LabelSelector(match_labels={"x": "y"})
    assert parse_selector(sel) is sel
    with pytest.raises(RefitError, match="not key=value"):
        parse_selector("env in (a,b)")
    with pytest.raises(RefitError, match="must not be empty"):
        parse_selector("")


def test_default_name_is_a_dns_label():
    assert default_name("Step_100.bf16") == "refit-step-100-bf16"
    assert len(default_name("v" * 100)) == 63


def test_spec_fields_set_what_no_keyword_does_and_merge_into_what_one_did():
    doc = build_refit(
        "wr", "/ckpt/1", "v1", fleet_selector={"app": "rollout"}, port=8000,
        admin_token_secret="admin", strategy="Rolling",
        spec_fields={"fleet": {"apiKeySecretRef": {"name": "api", "key": "key"}},
                     "strategy": {"maxUnavailable": 1}, "ttlSecondsAfterFinished": 0},
    )  # fmt: skip
    assert doc["spec"]["fleet"] == {
        "selector": {"matchLabels": {"app": "rollout"}, "matchExpressions": []},
        "port": 8000,
        "adminTokenSecretRef": {"name": "admin"},
        "apiKeySecretRef": {"name": "api", "key": "key"},
    }
    assert doc["spec"]["strategy"] == {"type": "Rolling", "maxUnavailable": 1}
    assert doc["spec"]["ttlSecondsAfterFinished"] == 0
    with pytest.raises(RefitError, match=r"strategy\.type"):
        build_refit("x", "/c", "v", fleet_selector="app=a", spec_fields={"strategy": {"type": "X"}})
