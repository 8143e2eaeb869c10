"""Suite `soak`: one `refit-operator` process, one simulated fleet, N WeightRefits applied one
after another as a trainer does, one per training step (apply step i, wait until Succeeded,
apply step i+1), on a real kube-apiserver + etcd (the scale suite's machinery: bench/scale.py).

Per refit: apply->Succeeded wall time (the harness polls the object every POLL_SECONDS, so a
sample is late by up to one interval plus one GET) and the operator's CPU seconds over the
cycle (from the previous refit's Succeeded to this one's). Every `every` refits (and before the
first): the operator's RSS (psutil), its reconcile ticks and the number of series on its
/metrics (a label that is never forgotten grows it), the WeightRefits in the namespace (those
being deleted counted apart), the simulated pods' versions, and the machine's load: the load
average and the CPU time of every process outside this benchmark (the machine is shared; a
slower end of the run with the same operator work per refit is the machine's doing). Over the
first and the last window of refits: API-server requests by verb, from the server's
apiserver_request_total, the harness's own requests removed. At the end: the WeightRefits left
once garbage collection settled, which the history policy says must be the newest
`history_limit` (the fleet's target among them).

What the issue asks of a long RL run: the median apply->Succeeded of the last 100 refits
within 10% of the first 100's, operator RSS growth under 10 MiB over 1,000 refits, and
WeightRefits kept as the policy says.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import apiserver
from bench.apiserver import WRITE_VERBS
from bench.results import Metric, summarize
from bench.scale import (
    GROUP,
    PLURAL,
    STRATEGIES,
    TERMINAL,
    VERSION,
    Bench,
    control_plane,
    operator_process,
    refit_body,
    sim_fleet,
    stop,
)
from testbed.controlplane import free_port
from testbed.simworker import make_sim_checkpoint

POLL_SECONDS = 0.05  # the harness's GET of the WeightRefit while it waits for Succeeded
STEP_TIMEOUT = 120.0  # seconds one refit may take before the soak stops
SETTLE_TIMEOUT = 30.0  # seconds the history collection may take after the last refit
WINDOW = 100  # refits compared at the start and at the end
SAMPLE_EVERY = 50  # refits between RSS / WeightRefit-count samples
DEFAULT_HISTORY_LIMIT = 10  # the operator's default (refit_operator.core.history)
RAW_EXTRA = ("poll_seconds", "seconds")  # keys of the result's raw beside SoakRun's

Log = Callable[[str], None]


@dataclass
class Sample:
    refits: int  # refits Succeeded when it was taken (0: before the first)
    rss_mib: float
    cpu_s: float  # the operator's CPU seconds since it started
    weightrefits: int  # in the namespace, those being deleted included
    terminating: int  # of those, deletion pending (finalizer)
    stale_pods: int = 0  # pods not reporting the last Succeeded refit's version
    t: float = 0.0  # seconds since the soak started
    load1: float = 0.0  # the machine's 1-minute load average
    busy_s: float = 0.0  # the machine's CPU seconds used so far (every core, every process)
    bench_s: float = 0.0  # of those, by this benchmark: operator, control plane, simulator, harness
    ticks: int = 0  # the operator's reconcile passes so far (refit_operator_reconciles_total)
    tick_errors: int = 0  # its failed reconcile passes so far
    series: int = 0  # samples on its /metrics page


@dataclass
class SoakRun:
    pods: int
    history_limit: int
    planned: int
    refit_s: list[float] = field(default_factory=list)  # apply->Succeeded, per refit
    cpu_s: list[float] = field(default_factory=list)  # operator CPU per refit cycle
    samples: list[Sample] = field(default_factory=list)
    every: int = SAMPLE_EVERY
    window: int = WINDOW
    left: int = -1  # WeightRefits in the namespace at the end (-1: not counted)
    left_names: list[str] = field(default_factory=list)
    settle_s: float = 0.0  # last Succeeded -> the count the policy says (or the timeout)
    requests_first: dict[str, int] = field(default_factory=dict)  # "VERB resource" -> count
    requests_last: dict[str, int] = field(default_factory=dict)
    failure: str = ""  # why the soak stopped early, if it did
    log_errors: int = 0  # ERROR lines in the operator's log
    log_error_lines: list[str] = field(default_factory=list)  # the first few of them

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SoakRun:
        doc = dict(doc)
        doc["samples"] = [Sample(**s) for s in doc.get("samples", [])]
        return cls(**doc)


# ------------------------------------------------------------------------- pure parts
def window_size(refits: int, window: int = WINDOW) -> int:
    """Refits compared at each end: `window`, or a third of a shorter run (`--quick`)."""
    return max(1, min(window, refits // 3))


def refit_name(step: int) -> str:
    """Zero-padded: the history policy orders refits created in the same second by name."""
    return f"step-{step:05d}"


def expected_left(history_limit: int, succeeded: int) -> int:
    """WeightRefits the policy keeps of `succeeded` finished ones (all Succeeded): the newest
    `history_limit`; the fleet's target is kept even with a limit of 0."""
    if succeeded <= 0:
        return 0
    return max(1, min(history_limit, succeeded))


def newest_names(history_limit: int, succeeded: int) -> list[str]:
    n = expected_left(history_limit, succeeded)
    return [refit_name(i) for i in range(succeeded - n + 1, succeeded + 1)]


@dataclass(frozen=True)
class Drift:
    first: float  # median of the first window
    last: float  # median of the last window
    ratio: float  # last / first


def drift(values: Sequence[float], window: int) -> Drift:
    """Medians of the first and the last `window` values and their ratio."""
    if not values:
        raise ValueError("drift needs at least one value")
    first = summarize(list(values[:window])).median
    last = summarize(list(values[-window:])).median
    return Drift(first, last, last / first if first else float("inf"))


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def at(samples: Sequence[Sample], refits: int) -> Sample | None:
    """The sample taken after `refits` refits, if one was."""
    return next((s for s in samples if s.refits == refits), None)


def per_refit_between(a: Sample, b: Sample) -> dict[str, float]:
    """What the operator and the machine did from sample a to sample b, per refit (ticks, CPU
    per tick) and per second (cores the rest of the machine used)."""
    refits = max(b.refits - a.refits, 1)
    ticks = b.ticks - a.ticks
    wall = max(b.t - a.t, 1e-9)
    other = (b.busy_s - a.busy_s) - (b.bench_s - a.bench_s)
    return {
        "ticks": ticks / refits,
        "cpu_per_tick_ms": 1000 * (b.cpu_s - a.cpu_s) / ticks if ticks else 0.0,
        "other_cores": max(other, 0.0) / wall,
        "bench_cores": (b.bench_s - a.bench_s) / wall,
    }


def trajectory(run: SoakRun, w: int) -> str:
    """Each window's median apply->Succeeded and, where samples bound it, the cores the rest
    of the machine used meanwhile: a slow window on a busy machine is the machine's doing."""
    parts = []
    for start in range(0, len(run.refit_s) - w + 1, w):
        median = summarize(run.refit_s[start : start + w]).median
        a, b = at(run.samples, start), at(run.samples, start + w)
        other = ""
        if a is not None and b is not None and b.busy_s:
            other = f" ({per_refit_between(a, b)['other_cores']:.2f})"
        parts.append(f"{start + 1}-{start + w}: {median:.3f}{other}")
    return ", ".join(parts)


def _per_refit(requests: dict[str, int], refits: int) -> dict[str, float]:
    return {k: round(v / refits, 2) for k, v in sorted(requests.items()) if v}


def soak_metrics(run: SoakRun) -> list[Metric]:
    """The suite's figures from one run (pure: unit-tested)."""
    out: list[Metric] = []
    n = len(run.refit_s)
    if n == 0:
        return out
    w = window_size(n, run.window)
    t = drift(run.refit_s, w)
    first_w, last_w = f"refits 1-{w}", f"refits {n - w + 1}-{n}"
    poll = f"polled every {POLL_SECONDS * 1000:.0f} ms (a sample is late by up to that + 1 GET)"
    out.append(Metric(f"apply->Succeeded, {first_w}", run.refit_s[:w], "s", note=poll))
    out.append(Metric(f"apply->Succeeded, {last_w}", run.refit_s[-w:], "s"))
    out.append(
        Metric(
            f"apply->Succeeded, median of the last {w} / the first {w}",
            [t.ratio],
            "x",
            "<= 1.10",
            f"{t.last:.3f} s / {t.first:.3f} s; {n} of {run.planned} refits, "
            f"{run.pods} pods, AllAtOnce; by window of {w} refits (median s, cores used by "
            f"processes outside the benchmark): {trajectory(run, w)}",
        )
    )
    out.append(Metric(f"apply->Succeeded, all {n} refits", run.refit_s, "s"))
    if run.cpu_s:
        c = drift(run.cpu_s, w)
        out.append(
            Metric(f"operator CPU per refit, {first_w}", [1000 * x for x in run.cpu_s[:w]], "ms")
        )
        out.append(
            Metric(
                f"operator CPU per refit, {last_w}",
                [1000 * x for x in run.cpu_s[-w:]],
                "ms",
                note=f"median last/first {c.ratio:.2f}; a cycle is one refit's Succeeded to "
                "the next one's: its passes, status writes, history collection and the idle "
                "ticks of the refits kept",
            )
        )
    if run.samples:
        rss = [s.rss_mib for s in run.samples]
        series = ", ".join(f"{s.refits}: {s.rss_mib:.1f}" for s in run.samples)
        out.append(
            Metric(
                "operator RSS growth, first -> last sample",
                [rss[-1] - rss[0]],
                "MiB",
                "< 10",
                f"psutil RSS every {run.every} refits (refits done: MiB): {series}",
            )
        )
        warm = [s for s in run.samples if s.refits >= run.every]
        if len(warm) >= 2:
            out.append(
                Metric(
                    f"operator RSS growth, refit {warm[0].refits} -> {warm[-1].refits}",
                    [warm[-1].rss_mib - warm[0].rss_mib],
                    "MiB",
                    note="after the first refits' warm-up (imports, connections, caches)",
                )
            )
            k = slope([s.refits for s in warm], [s.rss_mib for s in warm])
            out.append(
                Metric(
                    "operator RSS trend after warm-up (least squares)",
                    [1000 * k],
                    "MiB/1000 refits",
                )
            )
        if run.samples[-1].series:
            out.append(
                Metric(
                    "operator /metrics series, first -> last sample",
                    [run.samples[-1].series - run.samples[0].series],
                    "series",
                    note=f"{run.samples[0].series} -> {run.samples[-1].series}; a label never "
                    "forgotten (a deleted refit's, a pod's) would grow it with every refit",
                )
            )
        ends = [(first_w, at(run.samples, 0), at(run.samples, w))]
        ends.append((last_w, at(run.samples, n - w), at(run.samples, n)))
        for label, a, b in ends:
            if a is None or b is None or not b.busy_s:
                continue
            d = per_refit_between(a, b)
            loads = [s.load1 for s in run.samples if a.refits <= s.refits <= b.refits]
            out.append(
                Metric(
                    f"operator reconcile ticks per refit, {label}",
                    [d["ticks"]],
                    "ticks",
                    note=f"operator CPU per tick {d['cpu_per_tick_ms']:.1f} ms; "
                    f"failed ticks in the window: {b.tick_errors - a.tick_errors}",
                )
            )
            out.append(
                Metric(
                    f"CPU used by processes outside the benchmark, {label}",
                    [d["other_cores"]],
                    "cores",
                    note=f"the machine's noise (2 cores shared): the benchmark itself used "
                    f"{d['bench_cores']:.2f} cores; 1-minute load average at the samples: "
                    f"{loads}",
                )
            )
        most = max(s.weightrefits for s in run.samples)
        out.append(
            Metric(
                "WeightRefits in etcd, most seen at a sample",
                [most],
                "",
                f"<= {run.history_limit + 1}",
                f"the history limit ({run.history_limit}) plus the active refit; "
                f"counted every {run.every} refits right after a Succeeded, deleting ones "
                f"included (most of those: {max(s.terminating for s in run.samples)})",
            )
        )
    if run.left >= 0:
        want = expected_left(run.history_limit, n)
        newest = run.left_names == newest_names(run.history_limit, n)
        out.append(
            Metric(
                f"WeightRefits left after {n} refits",
                [run.left],
                "",
                f"<= {want}",
                f"the policy keeps exactly the newest {want} (--history-limit "
                f"{run.history_limit}): met only if exactly {want} are left and they are the "
                f"newest ({'they are' if newest else 'they are NOT'}: "
                f"{', '.join(run.left_names[:3])}{' ...' if len(run.left_names) > 3 else ''}); "
                f"settled {run.settle_s:.1f} s after the last Succeeded",
                met=run.left == want and newest,
            )
        )
    for label, requests, span in (
        (first_w, run.requests_first, w),
        (last_w, run.requests_last, w),
    ):
        if requests:
            writes = sum(v for k, v in requests.items() if k.split(" ")[0] in WRITE_VERBS)
            out.append(
                Metric(
                    f"API writes per refit, {label}",
                    [writes / span],
                    "req",
                    note=f"all requests per refit by verb/resource: {_per_refit(requests, span)}",
                )
            )
    return out


def notes_of(run: SoakRun) -> list[str]:
    notes = []
    if run.failure:
        notes.append(f"STOPPED EARLY after {len(run.refit_s)} refits: {run.failure}")
    if run.log_errors:
        notes.append(
            f"the operator logged {run.log_errors} ERROR lines; the first: "
            + " || ".join(run.log_error_lines)
        )
    stale = [s for s in run.samples if s.stale_pods]
    if stale:
        notes.append(
            "pods NOT at the Succeeded refit's version at samples: "
            + ", ".join(f"after {s.refits}: {s.stale_pods}" for s in stale)
        )
    return notes


# ------------------------------------------------------------------------- the run
class _Harness:
    """The soak's own API requests, to take them out of the server's counts."""

    def __init__(self, bench: Bench, ns: str) -> None:
        self.bench, self.ns = bench, ns
        self.requests: Counter[tuple[str, str]] = Counter()

    def create(self, body: dict[str, Any]) -> None:
        self.requests[("POST", PLURAL)] += 1
        self.bench.create_refit(self.ns, body)

    def phase(self, name: str) -> tuple[str | None, dict[str, Any]]:
        self.requests[("GET", PLURAL)] += 1
        doc, _ = self.bench.get_refit(self.ns, name)
        status = doc.get("status") or {}
        return status.get("phase"), status

    def refits(self) -> tuple[list[str], int]:
        """(names, how many of them are being deleted)."""
        self.requests[("LIST", PLURAL)] += 1
        items = self.bench.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)[
            "items"
        ]
        deleting = sum(1 for i in items if i["metadata"].get("deletionTimestamp"))
        return sorted(i["metadata"]["name"] for i in items), deleting

    def totals(self) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
        """(the API server's request counts, the harness's own so far)."""
        return apiserver.request_totals(self.bench.cp), Counter(self.requests)


def _window_requests(
    start: tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]],
    end: tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]],
) -> dict[str, int]:
    counts = apiserver.diff(end[0], start[0])
    counts.subtract(end[1] - start[1])
    return {f"{v} {r}": c for (v, r), c in sorted((+counts).items())}


def soak(
    bench: Bench,
    refits: int,
    pods: int,
    history_limit: int,
    log: Log,
    every: int = SAMPLE_EVERY,
) -> SoakRun:
    run = SoakRun(pods=pods, history_limit=history_limit, planned=refits, every=every)
    w = window_size(refits)
    ns = bench.cp.create_namespace("soak")
    ckpt_root = bench.work / "ckpt-soak"
    ckpt_root.mkdir()
    fleet = sim_fleet(pods, ckpt_root)
    h = _Harness(bench, ns)
    proc = None
    started = time.monotonic()
    try:
        bench.make_pods(ns, [p.ip for p in fleet.pods])
        port = free_port()
        extra = ["--history-limit", str(history_limit)]
        extra += ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1"]
        proc = bench.start_operator(ns, "soak", extra)
        me = operator_process(proc)
        ours = [
            me,
            psutil.Process(os.getpid()),
            *(psutil.Process(pid) for pid in bench.cp.pids.values()),
            *(psutil.Process(shard.proc.pid) for shard in fleet.shards),
        ]

        def sample(done: int, version: str | None) -> None:
            names, deleting = h.refits()
            stale = 0
            if version is not None:
                stale = sum(1 for s in fleet.states().values() if s["weight_version"] != version)
            busy = psutil.cpu_times()
            ticks, errors, series = scrape(port)
            run.samples.append(
                Sample(
                    refits=done,
                    rss_mib=me.memory_info().rss / 2**20,
                    cpu_s=sum(me.cpu_times()[:2]),
                    weightrefits=len(names),
                    terminating=deleting,
                    stale_pods=stale,
                    t=time.monotonic() - started,
                    load1=round(os.getloadavg()[0], 2),
                    busy_s=sum(busy) - busy.idle - getattr(busy, "iowait", 0.0),
                    bench_s=sum(_cpu(p) for p in ours),
                    ticks=ticks,
                    tick_errors=errors,
                    series=series,
                )
            )
            s = run.samples[-1]
            log(
                f"soak: {done}/{refits} refits, RSS {s.rss_mib:.1f} MiB, CPU {s.cpu_s:.1f} s, "
                f"{s.weightrefits} WeightRefits ({s.terminating} deleting)"
                + (f", {stale} pods STALE" if stale else "")
                + (
                    f", last {min(done, w)} median {summarize(run.refit_s[-w:]).median:.3f} s"
                    if done
                    else ""
                )
            )

        sample(0, None)
        marks = {0: h.totals()}
        cpu_before = sum(me.cpu_times()[:2])
        for i in range(1, refits + 1):
            if i - 1 == refits - w and refits - w not in marks:
                marks[refits - w] = h.totals()
            name = refit_name(i)
            ckpt = make_sim_checkpoint(ckpt_root / name, name)
            body = refit_body(name, fleet.port, ckpt, name, STRATEGIES["AllAtOnce"])
            t0 = time.monotonic()
            h.create(body)
            while True:
                phase, status = h.phase(name)
                if phase in TERMINAL:
                    break
                if proc.poll() is not None:
                    phase = f"operator exited with {proc.returncode}"
                    break
                if time.monotonic() - t0 > STEP_TIMEOUT:
                    phase = f"not finished in {STEP_TIMEOUT:.0f} s (phase {phase})"
                    break
                time.sleep(POLL_SECONDS)
            took = time.monotonic() - t0
            if phase != "Succeeded":
                run.failure = (
                    f"{name}: {phase}: {status.get('message', '')} "
                    f"(reason {status.get('reason', '')}); operator log tail: "
                    f"{bench.log_tail('soak')[-1500:]}"
                )
                log(f"soak: FAILED at {name}: {phase}: {status.get('message', '')}")
                break
            passed = int((status.get("probeSummary") or {}).get("passed", 0))
            if passed != pods:
                run.failure = f"{name}: Succeeded with {passed} of {pods} probes passed"
                break
            cpu_now = sum(me.cpu_times()[:2])
            run.refit_s.append(took)
            run.cpu_s.append(cpu_now - cpu_before)
            cpu_before = cpu_now
            if i == w:
                marks[w] = h.totals()
            if i % every == 0 or i == refits:
                sample(i, name)
        done = len(run.refit_s)
        if not run.failure and done >= w:
            end = h.totals()
            run.requests_first = _window_requests(marks[0], marks[w])
            if refits - w in marks:
                run.requests_last = _window_requests(marks[refits - w], end)
        # History collection runs on the tick that finishes a refit: give it time to settle.
        want = expected_left(history_limit, done)
        t_last = time.monotonic()
        names: list[str] = []
        while True:
            names, _ = h.refits()
            if len(names) == want or run.failure or time.monotonic() - t_last > SETTLE_TIMEOUT:
                break
            time.sleep(0.2)
        run.settle_s = time.monotonic() - t_last
        run.left, run.left_names = len(names), names
        log(
            f"soak: {run.left} WeightRefits left (the policy keeps {want}) after "
            f"{run.settle_s:.1f} s: {names}"
        )
    finally:
        if proc is not None:
            stop(proc)
        fleet.close()
        run.log_errors, run.log_error_lines = log_errors(bench.work / "soak.log")
    return run


def log_errors(path: Path, keep: int = 5) -> tuple[int, list[str]]:
    """(ERROR lines in an operator log, the first `keep` of them, each with the exception
    line that ends the traceback after it, if one does)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return 0, []
    hits = [i for i, line in enumerate(lines) if " ERROR " in line]
    out = []
    for i in hits[:keep]:
        text = lines[i]
        j = i + 1
        if j < len(lines) and lines[j].startswith("Traceback"):
            while j < len(lines) and (lines[j].startswith(("Traceback", " ")) or not lines[j]):
                j += 1
            if j < len(lines):
                text += " | " + lines[j]
        out.append(text[:400])
    return len(hits), out


def _cpu(p: psutil.Process) -> float:
    """CPU seconds of p and of its children it waited for (kubectl runs of the harness)."""
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def scrape(port: int) -> tuple[int, int, int]:
    """(reconcile passes, failed ones, series) from the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    ticks = errors = series = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series += 1
            if sample.name == "refit_operator_reconciles_total":
                ticks = int(sample.value)
            elif sample.name == "refit_operator_reconcile_errors_total":
                errors += int(sample.value)
    return ticks, errors, series


def run_suite(
    refits: int,
    pods: int,
    history_limit: int,
    log: Log,
    profile: Path | None = None,
) -> tuple[list[Metric], dict[str, Any], list[str]]:
    every = SAMPLE_EVERY if refits >= 6 * SAMPLE_EVERY else max(1, refits // 6)
    with control_plane("refit-bench-soak-", profile) as bench:
        run = soak(bench, refits, pods, history_limit, log, every)
    raw = run.to_json()
    raw["poll_seconds"] = POLL_SECONDS  # RAW_EXTRA: not a SoakRun field
    return soak_metrics(run), raw, notes_of(run)
