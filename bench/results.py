"""Pure core of the harness: samples -> medians, suite results -> JSON and a markdown table.

No I/O beyond the two write/read helpers at the bottom; the table is a function of the
result documents, so rerunning one suite (`--only`) rewrites the table from every JSON file.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int


def summarize(samples: list[float]) -> Summary:
    """Median and range of repeated measurements (the machine is shared: medians, not means)."""
    if not samples:
        raise ValueError("summarize needs at least one sample")
    return Summary(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclass
class Metric:
    """One reported figure. target: a human-readable bound such as "< 30" (same unit);
    met: whether the median satisfies it (None when there is no target)."""

    name: str
    samples: list[float]
    unit: str
    target: str | None = None
    note: str = ""
    met: bool | None = field(default=None)

    def __post_init__(self) -> None:
        if self.target is not None and self.met is None:
            self.met = check_target(self.summary.median, self.target)

    @property
    def summary(self) -> Summary:
        return summarize(self.samples)


def check_target(value: float, target: str) -> bool:
    """Evaluate "< x", "<= x", "> x", ">= x" against value."""
    for op in ("<=", ">=", "<", ">"):
        if target.startswith(op):
            bound = float(target[len(op) :].strip().split()[0])
            return {
                "<=": value <= bound,
                ">=": value >= bound,
                "<": value < bound,
                ">": value > bound,
            }[op]
    raise ValueError(f"target {target!r} must start with <, <=, > or >=")


@dataclass
class SuiteResult:
    suite: str
    title: str
    command: str
    date: str
    machine: dict[str, Any]
    metrics: list[Metric]
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for m, out in zip(self.metrics, doc["metrics"], strict=True):
            out["summary"] = asdict(m.summary)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SuiteResult:
        metrics = [
            Metric(
                name=m["name"],
                samples=list(m["samples"]),
                unit=m["unit"],
                target=m.get("target"),
                note=m.get("note", ""),
                met=m.get("met"),
            )
            for m in doc["metrics"]
        ]
        return cls(
            suite=doc["suite"],
            title=doc["title"],
            command=doc["command"],
            date=doc["date"],
            machine=doc["machine"],
            metrics=metrics,
            notes=list(doc.get("notes", [])),
            raw=doc.get("raw", {}),
        )


def fmt(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01:
        return f"{value:.3g}"
    return f"{value:.2e}"


def row_name(result: SuiteResult, metric: Metric) -> str:
    """The metric's name in the table. A scale run's rows carry the operator's lease: the same
    fleet size at another --scale-lease-seconds is another configuration, not a newer run."""
    lease = result.raw.get("lease_seconds") if result.suite == "scale" else None
    return f"{metric.name} (lease {lease} s)" if lease else metric.name


def regenerate_command(result: SuiteResult) -> str:
    """The command that rewrites this result in bench/results: the recorded one for its suite
    alone (``--only SUITE``), without ``--out`` (a run written elsewhere and copied here) or a
    remark after the arguments."""
    words = shlex.split(result.command.split("  (")[0])[3:]  # after "python -m bench"
    kept: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in ("--only", "--out"):
            skip = True
        elif not w.startswith(("--only=", "--out=")):
            kept.append(w)
    return shlex.join(["python", "-m", "bench", "--only", result.suite, *kept])


def current_rows(results: list[SuiteResult]) -> list[tuple[SuiteResult, Metric]]:
    """One row per (suite, row name): the newest result's (dates sort as text). The table
    shows these; an older run's rows belong in HISTORY.md."""
    newest: dict[tuple[str, str], tuple[SuiteResult, Metric]] = {}
    for r in sorted(results, key=lambda r: r.date):
        for m in r.metrics:
            newest[(r.suite, row_name(r, m))] = (r, m)
    keep = {id(m) for _, m in newest.values()}
    return [(r, m) for r in results for m in r.metrics if id(m) in keep]


def render_table(results: list[SuiteResult]) -> str:
    """Markdown: one row per metric, the newest run's (current_rows), each with the command
    that regenerates it; then one section per run that supplied rows (command, date, machine,
    load, notes)."""
    rows = current_rows(results)
    shown = [r for r in results if any(r is rr for rr, _ in rows)]
    lines = ["# Refit benchmark results", ""]
    lines.append("Generated by `python -m bench` (`make bench`) from the JSON files beside it: ")
    lines.append("one row per metric, from the newest run that measured it; older runs are in ")
    lines.append("HISTORY.md. Medians of repeated runs (`range (n)`: lowest–highest of n); ")
    lines.append("ratios are computed from measurements taken in the same run. ")
    lines.append("The machine is shared with other engineers: expect noise (load averages below).")
    lines.append("")
    lines.append("| suite | metric | median | range (n) | unit | target | met | regenerate |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r, m in rows:
        s = m.summary
        spread = f"{fmt(s.low)}–{fmt(s.high)} ({s.n})" if s.n > 1 else f"({s.n})"
        met = "" if m.met is None else ("yes" if m.met else "**no**")
        lines.append(
            f"| {r.suite} | {row_name(r, m)} | {fmt(s.median)} | {spread} | {m.unit} "
            f"| {m.target or ''} | {met} | `{regenerate_command(r)}` |"
        )
    for r in shown:
        lines += ["", f"## {r.suite}: {r.title}", ""]
        load = r.machine.get("loadavg_before"), r.machine.get("loadavg_after")
        lines.append(f"- command: `{r.command}`")
        lines.append(f"- date: {r.date}")
        lines.append(
            f"- machine: {r.machine.get('cores')} cores, {r.machine.get('mem_gib')} GiB, "
            f"load average before/after {load[0]} / {load[1]}"
        )
        current = {id(m) for rr, m in rows if rr is r}
        for m in r.metrics:
            if m.note and id(m) in current:
                lines.append(f"- {row_name(r, m)}: {m.note}")
        lines += [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "cores": os.cpu_count(),
        "mem_gib": round(mem_kib / 2**20, 1),
        "loadavg_before": loadavg(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_result(out_dir: Path, result: SuiteResult, stem: str | None = None) -> Path:
    """Writes out_dir/<stem>.json; stem defaults to the suite's name (a run of part of a
    suite, such as one large fleet size, may sit beside the full run under another stem)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or result.suite}.json"
    path.write_text(json.dumps(result.to_json(), indent=1, sort_keys=False) + "\n")
    return path


def read_results(out_dir: Path) -> list[SuiteResult]:
    return [
        SuiteResult.from_json(json.loads(p.read_text())) for p in sorted(out_dir.glob("*.json"))
    ]


def write_table(out_dir: Path, order: list[str]) -> Path:
    results = read_results(out_dir)
    rank = {name: i for i, name in enumerate(order)}
    # Results of one suite (the full run and partial ones beside it) in the order measured.
    results.sort(key=lambda r: (rank.get(r.suite, len(rank)), r.suite, r.date))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "README.md"
    path.write_text(render_table(results))
    return path
