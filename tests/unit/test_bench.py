"""The benchmark harness's pure parts: aggregation, targets, request counting, the table.
(The suites themselves run real servers: `python -m bench`, not the unit tests.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench import apiserver
from bench.results import (
    Metric,
    SuiteResult,
    check_target,
    read_results,
    render_table,
    summarize,
    write_result,
    write_table,
)
from bench.scale import RunResult, metrics_of


def _line(code: str, resource: str, sub: str, verb: str, value: int) -> str:
    labels = (
        f'code="{code}",component="apiserver",dry_run="",group="",resource="{resource}",'
        f'scope="resource",subresource="{sub}",verb="{verb}",version="v1"'
    )
    return f"apiserver_request_total{{{labels}}} {value}"


METRICS_TEXT = "\n".join(
    [
        "# HELP apiserver_request_total [STABLE] Counter of apiserver requests.",
        "# TYPE apiserver_request_total counter",
        _line("200", "pods", "status", "PATCH", 7),
        _line("409", "pods", "status", "PATCH", 1),
        _line("201", "events", "", "POST", 3),
        _line("200", "pods", "", "LIST", 4),
        _line("200", "", "/metrics", "GET", 9),  # a non-resource path: not counted
        "# TYPE apiserver_request_duration_seconds histogram",
        'apiserver_request_duration_seconds_bucket{le="0.1",resource="pods",verb="LIST"} 4',
        "",
    ]
)


def test_summarize_gives_the_median_and_range() -> None:
    s = summarize([3.0, 1.0, 10.0, 2.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


@pytest.mark.parametrize(
    ("value", "target", "met"),
    [(29.9, "< 30", True), (30.0, "< 30", False), (10.0, "<= 10", True),
     (0.49, ">= 0.5", False), (150, ">= 100", True), (1.2, "> 1 x", True)],
)  # fmt: skip
def test_targets(value: float, target: str, met: bool) -> None:
    assert check_target(value, target) is met
    assert Metric("m", [value], "s", target).met is met


def test_target_without_an_operator_is_refused() -> None:
    with pytest.raises(ValueError, match="must start with"):
        check_target(1.0, "30")


def test_request_totals_keep_resources_and_sum_codes() -> None:
    counts = apiserver.parse_request_totals(METRICS_TEXT)
    assert counts == Counter(
        {("PATCH", "pods/status"): 8, ("POST", "events"): 3, ("LIST", "pods"): 4}
    )
    before = Counter({("PATCH", "pods/status"): 2, ("LIST", "pods"): 4})
    d = apiserver.diff(counts, before)
    assert d == Counter({("PATCH", "pods/status"): 6, ("POST", "events"): 3})
    assert apiserver.writes(d) == 9
    assert apiserver.by_verb(counts) == {"LIST": 4, "PATCH": 8, "POST": 3}


def _run(n: int, strategy: str, wall: float, writes: int) -> RunResult:
    return RunResult(pods=n, strategy=strategy, wall_s=wall, cpu_s=wall / 2, peak_rss_mib=100,
                     requests={"PATCH pods": writes}, verbs={"PATCH": writes}, writes=writes,
                     probed=n)  # fmt: skip


def test_scale_metrics_per_pod_targets_and_growth_exponent() -> None:
    runs = [
        _run(10, "AllAtOnce", 1.0, 80),
        _run(10, "AllAtOnce", 3.0, 80),
        _run(1000, "AllAtOnce", 40.0, 12000),
        _run(10, "Rolling25", 2.0, 90),
        _run(1000, "Rolling25", 200.0, 9000),
    ]
    by_name = {m.name: m for m in metrics_of(runs, [10, 1000])}
    wall = by_name["AllAtOnce 1000 pods: wall apply->Succeeded"]
    assert (wall.summary.median, wall.target, wall.met) == (40.0, "< 30", False)
    assert by_name["AllAtOnce 10 pods: wall apply->Succeeded"].target is None
    assert by_name["AllAtOnce 10 pods: API writes per pod"].met is True
    assert by_name["AllAtOnce 1000 pods: API writes per pod"].met is False
    assert by_name["AllAtOnce 10 pods: wall per pod"].summary.median == 200.0  # ms
    # 10 -> 1000 pods: median wall 2 s -> 40 s: exponent log(20)/log(100) = 0.65
    k = by_name["AllAtOnce: wall-time growth exponent 10->1000"]
    assert k.summary.median == pytest.approx(0.6505, abs=1e-3) and k.met is True
    k = by_name["Rolling25: wall-time growth exponent 10->1000"]
    assert k.summary.median == pytest.approx(1.0) and k.met is True


def test_results_round_trip_and_render(tmp_path: Path) -> None:
    machine = {"cores": 2, "mem_gib": 24.0, "loadavg_before": [1.0, 2.0, 3.0],
               "loadavg_after": [2.0, 2.0, 3.0]}  # fmt: skip
    a = SuiteResult("scale", "Scale", "python -m bench --only scale", "2026-01-01 00:00 UTC",
                    machine, [Metric("wall", [1.0, 3.0, 2.0], "s", "< 30", note="why")],
                    notes=["a note"])  # fmt: skip
    b = SuiteResult("memory", "Mem", "python -m bench", "2026-01-01 00:00 UTC", machine,
                    [Metric("growth", [50.0], "MiB", "<= 30")])  # fmt: skip
    write_result(tmp_path, a)
    write_result(tmp_path, b)
    back = {r.suite: r for r in read_results(tmp_path)}
    assert back["scale"].metrics[0].samples == [1.0, 3.0, 2.0]
    assert back["scale"].metrics[0].met is True and back["memory"].metrics[0].met is False
    table = write_table(tmp_path, ["scale", "memory"]).read_text()
    assert table == render_table([back["scale"], back["memory"]])
    assert "| scale | wall | 2 | 1–3 (3) | s | < 30 | yes |" in table
    assert "| memory | growth | 50.0 | (1) | MiB | <= 30 | **no** |" in table
    assert table.index("| scale |") < table.index("| memory |")
    assert "`python -m bench --only scale`" in table and "2 cores" in table
    assert "- wall: why" in table and "- a note" in table


def test_an_unfinished_run_is_a_lower_bound_and_gets_no_per_pod_verdict() -> None:
    timed_out = _run(1000, "AllAtOnce", 180.0, 4000)
    timed_out.completed, timed_out.updated, timed_out.timeout = False, 12, 180.0
    runs = [_run(10, "AllAtOnce", 1.0, 150), timed_out]
    by_name = {m.name: m for m in metrics_of(runs, [10, 1000])}
    wall = by_name["AllAtOnce 1000 pods: wall apply->Succeeded"]
    assert wall.met is False and "NOT finished at the 180 s limit" in wall.note
    assert "[12]" in wall.note
    writes = by_name["AllAtOnce 1000 pods: API writes per pod"]
    assert writes.target is None and writes.met is None and writes.note.startswith("PARTIAL")
    k = by_name["AllAtOnce: wall-time growth exponent 10->1000"]
    assert "lower bound" in k.note
