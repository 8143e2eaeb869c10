"""The benchmark harness's pure parts: aggregation, targets, request counting, the table.
(The suites themselves run real servers: `python -m bench`, not the unit tests.)"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from bench import apiserver, overhead, scale, soak
from bench.results import (
    Metric,
    SuiteResult,
    check_target,
    read_results,
    regenerate_command,
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
    assert (
        "| scale | wall | 2 | 1–3 (3) | s | < 30 | yes | `python -m bench --only scale` |" in table
    )
    assert (
        "| memory | growth | 50.0 | (1) | MiB | <= 30 | **no** | `python -m bench --only memory` |"
        in table
    )
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


# --- scale: object size, 10,000 pods, the simulator's shards ----------------------------------
def test_scale_object_size_and_the_10000_pod_targets() -> None:
    big = _run(10000, "AllAtOnce", 100.0, 40000)
    big.object_bytes, big.object_bytes_max = 30 * 1024, 40 * 1024
    old = _run(1000, "AllAtOnce", 12.0, 4000)  # measured before sizes were recorded
    by_name = {m.name: m for m in metrics_of([old, big], [1000, 10000])}
    wall = by_name["AllAtOnce 10000 pods: wall apply->Succeeded"]
    assert (wall.target, wall.met) == ("<= 60", False)
    writes = by_name["AllAtOnce 10000 pods: API writes per pod"]
    assert (writes.target, writes.met) == ("<= 2.5", False)
    assert by_name["AllAtOnce 1000 pods: API writes per pod"].target == "<= 10"
    size = by_name["AllAtOnce 10000 pods: WeightRefit object size"]
    assert (size.summary.median, size.unit, size.target, size.met) == (40.0, "KiB", "< 256", True)
    assert "[30.0]" in size.note
    assert "AllAtOnce 1000 pods: WeightRefit object size" not in by_name
    assert by_name["AllAtOnce 10000 pods: API writes per pod"].summary.median == 4.0


def test_each_run_reads_against_its_own_bare_write_floor() -> None:
    runs = [_run(1000, "AllAtOnce", 12.0, 2000), _run(1000, "AllAtOnce", 18.0, 2000)]
    runs[0].write_floor_s, runs[1].write_floor_s = 3.0, 2.0
    unfloored = _run(10, "AllAtOnce", 1.0, 20)  # a run stored before the floor was measured
    by_name = {m.name: m for m in metrics_of([*runs, unfloored], [10, 1000])}
    assert by_name["AllAtOnce 1000 pods: bare write floor"].samples == [3.0, 2.0]
    ratio = by_name["AllAtOnce 1000 pods: wall / bare write floor"]
    assert (ratio.samples, ratio.unit) == ([4.0, 9.0], "x")  # not 15 s / 2.5 s
    assert "AllAtOnce 10 pods: bare write floor" not in by_name


@pytest.mark.parametrize(
    ("n", "per_shard", "sizes"),
    [(4, 9488, [4]), (10000, 9488, [5000, 5000]), (7, 3, [3, 2, 2]), (9488, 9488, [9488])],
)
def test_a_fleet_is_split_evenly_over_the_fewest_simulators(
    n: int, per_shard: int, sizes: list[int]
) -> None:
    got = scale.shard_sizes(n, per_shard)
    assert got == sizes and sum(got) == n and max(got) <= per_shard


def test_refit_body_selects_the_bench_fleet() -> None:
    body = scale.refit_body("step-1", 8000, Path("/ckpt/1"), "v1", {"type": "AllAtOnce"},
                            ttlSecondsAfterFinished=5)  # fmt: skip
    assert body["metadata"] == {"name": "step-1"}
    assert body["spec"]["fleet"] == {
        "selector": {"matchLabels": scale.LABELS, "matchExpressions": []},
        "port": 8000,
        "adminTokenSecretRef": {"name": scale.ADMIN_SECRET},  # the pods run the guard
    }
    assert body["spec"]["checkpoint"] == {"path": "/ckpt/1", "version": "v1"}
    assert body["spec"]["ttlSecondsAfterFinished"] == 5


def test_a_partial_run_sits_beside_the_full_one(tmp_path: Path) -> None:
    machine = {"cores": 2, "loadavg_before": [1.0, 1.0, 1.0]}
    full = SuiteResult("scale", "Scale", "python -m bench", "2026-01-01 08:00 UTC", machine,
                       [Metric("AllAtOnce 10 pods: wall", [1.0], "s")])  # fmt: skip
    big = SuiteResult("scale", "Scale", "python -m bench --only scale --scale-sizes 10000",
                      "2026-01-02 08:00 UTC", machine,
                      [Metric("AllAtOnce 10000 pods: wall", [90.0], "s")])  # fmt: skip
    assert write_result(tmp_path, big, "scale-10000").name == "scale-10000.json"
    write_result(tmp_path, full)
    table = write_table(tmp_path, ["scale"]).read_text()
    assert table.index("10 pods: wall") < table.index("10000 pods: wall")
    assert "`python -m bench --only scale --scale-sizes 10000`" in table


def test_the_table_keeps_the_newest_row_per_metric_and_configuration(tmp_path: Path) -> None:
    machine = {"cores": 2, "loadavg_before": [1.0, 1.0, 1.0]}

    def run(date: str, lease: int, wall: float, command: str) -> SuiteResult:
        return SuiteResult("scale", "Scale", command, date, machine,
                           [Metric("AllAtOnce 10000 pods: wall", [wall], "s", note=f"w{wall}")],
                           raw={"lease_seconds": lease})  # fmt: skip

    cmd = "python -m bench --only scale --scale-sizes 10000"
    write_result(tmp_path, run("2026-01-01 08:00 UTC", 15, 100.0, cmd), "a")
    write_result(tmp_path, run("2026-01-03 08:00 UTC", 15, 90.0, cmd), "b")
    write_result(tmp_path, run("2026-01-02 08:00 UTC", 5, 200.0,
                               f"{cmd} --scale-lease-seconds 5 --out /tmp/x"), "c")  # fmt: skip
    table = write_table(tmp_path, ["scale"]).read_text()
    rows = [line for line in table.splitlines() if line.startswith("| scale |")]
    assert len(rows) == 2  # the older lease-15 run is gone: HISTORY.md's
    assert "| AllAtOnce 10000 pods: wall (lease 15 s) | 90.0 |" in rows[1]
    assert "| AllAtOnce 10000 pods: wall (lease 5 s) | 200.0 |" in rows[0]
    # the command that rewrites the row here: no --out
    assert rows[0].endswith(f"`{cmd} --scale-lease-seconds 5` |")
    assert "w100.0" not in table and "w90.0" in table


def test_the_regenerating_command_runs_the_suite_alone() -> None:
    def cmd(command: str) -> str:
        return regenerate_command(SuiteResult("memory", "", command, "", {}, []))

    assert cmd("python -m bench") == "python -m bench --only memory"
    assert cmd("python -m bench --only memory --out /tmp/o") == "python -m bench --only memory"
    assert cmd("python -m bench --quick  (a remark)") == "python -m bench --only memory --quick"


# --- soak -------------------------------------------------------------------------------------
def test_soak_windows_names_and_what_the_policy_keeps() -> None:
    assert [soak.window_size(n) for n in (1000, 300, 60, 2)] == [100, 100, 20, 1]
    # Refits created in one second are ordered by name: padding keeps step order.
    names = [soak.refit_name(i) for i in (9, 10, 100, 1000)]
    assert names == sorted(names) == ["step-00009", "step-00010", "step-00100", "step-01000"]
    assert soak.expected_left(10, 1000) == 10
    assert soak.expected_left(10, 4) == 4
    assert soak.expected_left(0, 1000) == 1  # the fleet's target is always kept
    assert soak.expected_left(10, 0) == 0
    assert soak.newest_names(3, 12) == ["step-00010", "step-00011", "step-00012"]


def test_soak_drift_and_slope() -> None:
    d = soak.drift([1.0, 2.0, 3.0, 9.0, 4.0, 4.0, 5.0], 3)
    assert (d.first, d.last, d.ratio) == (2.0, 4.0, 2.0)
    with pytest.raises(ValueError):
        soak.drift([], 3)
    assert soak.slope([0, 50, 100], [10.0, 11.0, 12.0]) == pytest.approx(0.02)
    assert soak.slope([5], [1.0]) == 0.0 and soak.slope([5, 5], [1.0, 2.0]) == 0.0


def _soak_run(later: float, rss_end: float, left: int) -> soak.SoakRun:
    n = 300
    seconds = [0.30] * 100 + [0.5] * 100 + [later] * 100
    samples = [
        soak.Sample(refits=i, rss_mib=rss, cpu_s=i / 10, weightrefits=w, terminating=t)
        for i, rss, w, t in [(0, 120.0, 0, 0), (50, 121.0, 11, 1), (150, 121.5, 10, 0),
                             (300, rss_end, 10, 0)]
    ]  # fmt: skip
    return soak.SoakRun(
        pods=4, history_limit=10, planned=n, refit_s=seconds, cpu_s=[0.1] * 100 + [0.2] * 200,
        samples=samples, left=left, left_names=soak.newest_names(10, n)[:left],
        requests_first={"POST events": 800, "PATCH pods/status": 1200, "LIST pods": 500},
        requests_last={"POST events": 800, "DELETE weightrefits": 100, "GET weightrefits": 7},
    )  # fmt: skip


def test_soak_metrics_meet_the_issue_targets() -> None:
    by_name = {m.name: m for m in soak.soak_metrics(_soak_run(0.32, 125.0, 10))}
    ratio = by_name["apply->Succeeded, median of the last 100 / the first 100"]
    assert ratio.summary.median == pytest.approx(0.32 / 0.30) and ratio.met is True
    assert ratio.target == "<= 1.10"
    assert by_name["apply->Succeeded, refits 1-100"].summary.n == 100
    assert by_name["apply->Succeeded, refits 201-300"].summary.median == 0.32
    assert by_name["apply->Succeeded, all 300 refits"].summary.high == 0.5
    cpu = by_name["operator CPU per refit, refits 201-300"]
    assert cpu.summary.median == 200.0 and "last/first 2.00" in cpu.note
    rss = by_name["operator RSS growth, first -> last sample"]
    assert (rss.summary.median, rss.target, rss.met) == (5.0, "< 10", True)
    assert by_name["operator RSS growth, refit 50 -> 300"].summary.median == 4.0
    trend = by_name["operator RSS trend after warm-up (least squares)"]
    assert trend.unit == "MiB/1000 refits" and trend.summary.median > 0
    most = by_name["WeightRefits in etcd, most seen at a sample"]
    assert (most.summary.median, most.target, most.met) == (11, "<= 11", True)
    left = by_name["WeightRefits left after 300 refits"]
    assert (left.summary.median, left.met) == (10, True) and "they are:" in left.note
    writes = by_name["API writes per refit, refits 1-100"]
    assert writes.summary.median == 20.0  # (800 POST + 1200 PATCH) / 100; LIST is a read
    assert "'LIST pods': 5.0" in writes.note
    assert by_name["API writes per refit, refits 201-300"].summary.median == 9.0


def test_soak_metrics_flag_drift_growth_and_a_wrong_history() -> None:
    by_name = {m.name: m for m in soak.soak_metrics(_soak_run(0.34, 131.0, 9))}
    assert by_name["apply->Succeeded, median of the last 100 / the first 100"].met is False
    assert by_name["operator RSS growth, first -> last sample"].met is False
    left = by_name["WeightRefits left after 300 refits"]
    assert left.met is False  # fewer than the policy keeps is as wrong as more
    run = _soak_run(0.3, 120.0, 10)
    run.left_names = ["step-00001", *run.left_names[1:]]  # an old one kept, a new one gone
    left = {m.name: m for m in soak.soak_metrics(run)}["WeightRefits left after 300 refits"]
    assert left.met is False and "they are NOT" in left.note


def test_soak_notes_and_json_round_trip() -> None:
    run = _soak_run(0.3, 120.0, 10)
    run.samples[2].stale_pods = 2
    run.failure = "step-00301: Failed: probe"
    notes = soak.notes_of(run)
    assert notes[0].startswith("STOPPED EARLY after 300 refits: step-00301")
    assert "after 150: 2" in notes[1]
    assert soak.SoakRun.from_json(json.loads(json.dumps(run.to_json()))) == run
    assert soak.soak_metrics(soak.SoakRun(pods=4, history_limit=10, planned=5)) == []


def test_soak_ticks_and_the_machines_noise_per_window() -> None:
    run = _soak_run(0.3, 120.0, 10)
    run.samples = [
        soak.Sample(refits=r, rss_mib=120.0, cpu_s=cpu, weightrefits=10, terminating=0, t=t,
                    load1=load, busy_s=busy, bench_s=ours, ticks=ticks, series=series)
        for r, cpu, t, load, busy, ours, ticks, series in [
            (0, 0.0, 0.0, 1.0, 0.0, 0.0, 0, 35),
            (100, 14.0, 40.0, 1.5, 60.0, 50.0, 2000, 595),
            (200, 28.0, 80.0, 2.0, 120.0, 100.0, 4000, 595),
            (300, 42.0, 130.0, 4.0, 210.0, 100.0 + 50.0, 6000, 600),
        ]
    ]  # fmt: skip
    by_name = {m.name: m for m in soak.soak_metrics(run)}
    ticks = by_name["operator reconcile ticks per refit, refits 1-100"]
    assert ticks.summary.median == 20.0 and "CPU per tick 7.0 ms" in ticks.note
    other = by_name["CPU used by processes outside the benchmark, refits 1-100"]
    assert other.summary.median == pytest.approx(10 / 40) and other.unit == "cores"
    other = by_name["CPU used by processes outside the benchmark, refits 201-300"]
    assert other.summary.median == pytest.approx(40 / 50) and "[2.0, 4.0]" in other.note
    series = by_name["operator /metrics series, first -> last sample"]
    assert series.summary.median == 565 and "35 -> 600" in series.note
    assert soak.at(run.samples, 100) is run.samples[1] and soak.at(run.samples, 150) is None


def test_soak_reads_errors_from_the_operator_log(tmp_path: Path) -> None:
    log = tmp_path / "soak.log"
    log.write_text(
        "2026 INFO refit_operator: fine\n"
        "2026 ERROR refit_operator.handlers: reconcile of soak/step-00003 failed: boom\n"
        "Traceback (most recent call last):\n"
        '  File "engine.py", line 1, in tick\n'
        "    for k in self.known.values():\n"
        "RuntimeError: dictionary changed size during iteration\n"
        "2026 ERROR asyncio: Unclosed client session\n"
    )
    n, lines = soak.log_errors(log)
    assert n == 2
    assert lines[0] == (
        "2026 ERROR refit_operator.handlers: reconcile of soak/step-00003 failed: boom | "
        "RuntimeError: dictionary changed size during iteration"
    )
    assert lines[1] == "2026 ERROR asyncio: Unclosed client session"
    assert soak.log_errors(tmp_path / "missing.log") == (0, [])
    run = _soak_run(0.3, 120.0, 10)
    run.log_errors, run.log_error_lines = n, lines
    assert soak.notes_of(run)[0].startswith("the operator logged 2 ERROR lines")


def test_soak_trajectory_names_each_window_and_the_machines_load() -> None:
    run = _soak_run(0.3, 120.0, 10)
    run.samples = [
        soak.Sample(refits=r, rss_mib=120.0, cpu_s=0.0, weightrefits=10, terminating=0, t=t,
                    busy_s=busy, bench_s=10.0)
        for r, t, busy in [(0, 0.0, 10.0), (100, 50.0, 60.0)]
    ]  # fmt: skip
    assert soak.trajectory(run, 100) == ("1-100: 0.300 (1.00), 101-200: 0.500, 201-300: 0.300")


# --- overhead ---------------------------------------------------------------------------------
def test_overhead_quantiles_and_ratios_of_one_run() -> None:
    assert overhead.p90([float(x) for x in range(1, 11)]) == pytest.approx(9.1)  # numpy's
    c = overhead.compare([200.0, 100.0, 300.0], [50.0, 100.0, 150.0])
    assert (c.operator_p50, c.direct_p50, c.ratio_p50) == (200.0, 100.0, 2.0)
    assert c.ratio_p90 == pytest.approx(280.0 / 140.0)
    rows = {
        m.name: m
        for m in overhead.comparison_metrics(
            "floor", [200.0, 100.0, 300.0], [50.0, 100.0, 150.0], "<= 100", ("<= 1.2", "<= 1.4")
        )
    }
    assert rows["floor: operator-driven, p50"].met is False
    assert rows["floor: operator-driven / direct, p50"].summary.median == 2.0
    assert rows["floor: operator-driven / direct, p90"].target == "<= 1.4"


def test_overhead_phases_tile_an_operator_driven_refit() -> None:
    records = {
        "pod-0": {"started": 10.10, "finished": 10.40,
                  "step_seconds": {"drain": 0.02, "stage": 0.03, "load": 0.02, "probe": 0.05}},
        # finished first: its slower stage is not on the path to Succeeded
        "pod-1": {"started": 10.12, "finished": 10.35, "step_seconds": {"stage": 0.09}},
    }  # fmt: skip
    calls = {"pod-0": [{"step": "refit_info", "at": 10.03, "seconds": 0.01},
                       {"step": "completions", "at": 10.05, "seconds": 0.02},
                       {"step": "get_world_size", "at": 10.08, "seconds": 0.0},
                       {"step": "completions", "at": 10.30, "seconds": 0.02}]}  # fmt: skip
    s = overhead.OperatorSample(began=10.0, ended=10.5, created=10.01, records=records,
                                calls=calls)  # fmt: skip
    p = overhead.phases(s, ("stage", "load"))
    assert p["total"] == 500.0 and p["submit"] == 10.0
    assert p["submit -> first preflight call"] == 20.0 and p["preflight"] == 50.0
    assert p["preflight -> pass start"] == 20.0
    assert (p["pre-transfer steps"], p["transfer"], p["post-transfer steps"]) == (20, 50, 50)
    assert p["claim + records"] == 180.0  # 300 ms of pass (first start -> last end) - steps
    assert p["final reconcile"] == 100.0
    # The slowest pod's steps one by one, beside the direct side's (not part of the tiling).
    assert (p["step: drain"], p["step: stage"], p["step: probe"]) == (20, 30, 50)
    assert p["step: sleep"] == 0
    tiled = sum(v for k, v in p.items() if k not in ("total", "pass (slowest pod)")
                and not k.startswith(("pod time", "step: ")))  # fmt: skip
    assert tiled == pytest.approx(p["total"])
    direct = [{"steps": [{"drain": 0.01, "probe": 0.05}, {"drain": 0.03}]},
              {"steps": [{"drain": 0.02}, {"drain": 0.02, "probe": 0.01}]}]  # fmt: skip
    rows = {m.name: m.samples for m in overhead.step_rows("x", direct, ("stage", "load"))}
    assert rows["x: direct step: drain"] == pytest.approx([30, 20])  # the slower pod's, per sample
    assert rows["x: direct step: probe"] == pytest.approx([50, 10])


def test_overhead_alternates_the_sides_and_drops_each_warm_up() -> None:
    order: list[tuple[str, int]] = []

    def operator_side(i: int) -> overhead.OperatorSample:
        order.append(("op", i))
        return overhead.OperatorSample(began=0.0, ended=float(i))

    async def direct_side(i: int) -> dict[str, float]:
        order.append(("direct", i))
        return {"pass_ms": float(i), "preflight_ms": 0.0}

    ops, direct = asyncio.run(
        overhead.alternate(3, "t", lambda _: None, operator_side, direct_side)
    )
    assert order == [("op", 0), ("direct", 0), ("direct", 1), ("op", 1),
                     ("op", 2), ("direct", 2), ("direct", 3), ("op", 3)]  # fmt: skip
    assert [s.ended for s in ops] == [1.0, 2.0, 3.0]
    assert [d["pass_ms"] for d in direct] == [1.0, 2.0, 3.0]
