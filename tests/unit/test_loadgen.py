"""The load generator's bookkeeping (testbed/loadgen.py); its traffic runs against real vLLM in
tests/e2e/test_refit_under_load.py."""

from __future__ import annotations

import pytest

from testbed.loadgen import NotLoopback, Record, Span, Target, latency_percentiles, parse_spans


def test_targets_off_loopback_are_refused() -> None:
    Target("p", "http://127.0.0.9:8000")
    Target("p", "http://localhost:8000")
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://[::1]:80"):
        with pytest.raises(NotLoopback, match="only to loopback"):
            Target("p", url)


def test_spans_and_versions_from_vllm_final_choice() -> None:
    choice = {"weight_versions": [{"version": "A", "start": 0, "end": 3},
                                  {"version": "B", "start": 3, "end": 9}]}  # fmt: skip
    spans = parse_spans(choice)
    assert spans == (Span("A", 0, 3), Span("B", 3, 9))
    r = Record(0, 0, "p", 1.0, end=2.5, outcome="ok", spans=spans)
    assert r.versions == ("A", "B") and r.latency == 1.5
    assert parse_spans({"weight_versions": None}) == ()


def test_latency_percentiles_count_only_served_requests() -> None:
    rs = [Record(i, 0, "p", 0.0, end=float(i + 1), outcome="ok") for i in range(100)]
    rs.append(Record(100, 0, "p", 0.0, end=1000.0, outcome="aborted"))
    assert latency_percentiles(rs, 0.5, 0.99) == [50.0, 99.0]
    assert all(x != x for x in latency_percentiles([], 0.5))  # NaN: nothing served
