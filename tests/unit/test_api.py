"""The models of core/api.py read and write the WeightRefit as the API server stores it.

(The CRD is generated from them: tests/unit/test_gen_crd.py holds what it makes to what the
models mean, test_generated.py the committed file to what it makes.)"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from refit_operator.core import api


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
