"""A picture of one refit instead of a log: per-pod probe results and a per-pod step timeline.

    python -m refit_operator.tools.report --refit NAME -n NAMESPACE [--kubeconfig PATH] \\
        --out report.png

reads the WeightRefit and its fleet's pods from the API server and draws every pod: each pod's
own record (its refit.rollout.dev/progress annotation) folded with the refit's status.pods,
which lists only the pods that need attention. `render(status, out, ...)` draws from a status
dict (`.status` of a WeightRefit) directly, or from every pod's result (`pods=`);
`render_refit(doc, out, pods=...)` from the WeightRefit and its fleet's Pod objects;
`figure(status, ...)` is the Figure `render` saves. Needs matplotlib (the `report` extra).

`render_grpo(run, out)` draws a training run through Refit instead: reward and refit time
per step, from the run document `testbed/grpo_trainer.py` writes (the `refit[trl]`
integration's StepRecords and the reward TRL logged).

The headline is the time out of traffic: the title gives the refit's worst and median, and
the timeline shades each pod's window out of traffic (its readiness condition False) behind
its steps, hatched where the pod is still out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from refit_worker.contract import API_GROUP

from ..core import api, times, traffic
from ..core.podflow import STEPS, Progress
from ..core.views import pod_views, seconds, version_of

VERDICT_COLORS: Final = {"Pass": "#2e9e44", "Fail": "#d62728", "Inconclusive": "#ff9f1c"}
NO_PROBE_COLOR: Final = "#b0b0b0"
# Behind the steps of the timeline: a pod's window out of traffic; hatched while it is still out.
OUT_OF_TRAFFIC_COLOR: Final = "#f2c4c4"
STILL_OUT_EDGE: Final = "#d62728"
# Pod name -> (epoch seconds the pod left traffic, epoch seconds it came back; None: still out).
Windows = Mapping[str, tuple[float, float | None]]
# Up to this many pods each gets a labelled row of its own; a larger fleet is drawn whole, in
# a picture of fixed height, without per-pod labels (`kubectl refit status NAME` lists them).
LABELLED_ROWS: Final = 100
DPI: Final = 110
# The status message under the report is wrapped at this many characters (the figure is 15 in).
MESSAGE_WIDTH: Final = 160
# Points kept free between a pod's phase label and the timeline's right edge.
LABEL_MARGIN: Final = 8.0
# The parts of a GRPO step's time (StepRecord fields), stacked in this order.
GRPO_TIMES: Final = (
    ("publish_seconds", "publish (reference + send)", "#1f77b4"),
    ("operator_seconds", "operator (refit → Succeeded)", "#ff7f0e"),
    ("generation_seconds", "generation (rollouts)", "#2ca02c"),
)
# One color per step of the sequence, in order (tab10 + three).
STEP_COLORS: Final[dict[str, str]] = dict(
    zip(
        STEPS,
        (
            "#1f77b4",
            "#aec7e8",
            "#9467bd",
            "#17becf",
            "#ff7f0e",
            "#ffbb78",  # receive: a broadcast's load
            "#c5b0d5",
            "#8c564b",
            "#e377c2",
            "#bcbd22",  # checksum: the read-back
            "#2ca02c",
            "#7f7f7f",
        ),
        strict=True,
    )
)


def render(
    status: Mapping[str, Any],
    out: Path,
    *,
    thresholds: Mapping[str, Any] | None = None,
    title: str = "",
    pods: Sequence[api.PodResult] | None = None,
    windows: Windows | None = None,
) -> Path:
    """Draw the refit `status` (a WeightRefit .status dict) as a PNG at `out`.

    thresholds: spec.probe.thresholds (camelCase dict); the API defaults when None.
    pods: every pod's result (status.fleet_results); None draws the pods status.pods lists.
    windows: each pod's window out of traffic (render_refit reads them from the pods'
    records); None: from the results' outOfTrafficSeconds, ending at their completionTime.
    """
    fig = figure(status, thresholds=thresholds, title=title, pods=pods, windows=windows)
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def figure(
    status: Mapping[str, Any],
    *,
    thresholds: Mapping[str, Any] | None = None,
    title: str = "",
    pods: Sequence[api.PodResult] | None = None,
    windows: Windows | None = None,
) -> Any:
    """The matplotlib Figure `render` saves (the caller closes it), laid out as saved: the
    timeline's legend within its height and every pod's phase label inside the timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    st = api.WeightRefitStatus.model_validate(dict(status))
    th = api.Thresholds.model_validate(dict(thresholds or {}))
    pods = sorted(st.pods if pods is None else pods, key=lambda p: p.name)
    if not pods:
        raise ValueError("the refit status lists no pods: nothing to draw")

    names = [p.name for p in pods]
    # A probe that scored no tokens (inconclusive, garbage answers) measured nothing: its zeros
    # are defaults, not values.
    probed = [p.probe if p.probe and p.probe.tokens > 0 else None for p in pods]
    colors = [VERDICT_COLORS[p.probe.verdict] if p.probe else NO_PROBE_COLOR for p in pods]
    many = len(pods) > 24
    huge = len(pods) > LABELLED_ROWS
    # One timeline row per pod; above LABELLED_ROWS pods the rows share a fixed height (a
    # 10,000-pod fleet is a band of colour per step) and only the title names counts.
    rows_height = 0.28 * min(len(pods), LABELLED_ROWS)

    fig = plt.figure(figsize=(15, 5.5 + rows_height), dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=[4.5, 1.2 + rows_height])
    panels = (
        (
            "mean |Δlogprob| per token",
            [p.mean_abs_logprob_diff if p else None for p in probed],
            th.mean_abs_logprob_diff,
            "meanAbsLogprobDiff",
        ),
        (
            "max |Δlogprob| (worst token)",
            [p.max_abs_logprob_diff if p else None for p in probed],
            th.max_abs_logprob_diff,
            "maxAbsLogprobDiff",
        ),
        (
            "|NLL − reference NLL|",
            [abs(p.nll - p.reference_nll) if p else None for p in probed],
            th.nll_diff,
            "nllDiff",
        ),
    )
    for column, (label, values, limit, field) in enumerate(panels):
        ax = fig.add_subplot(grid[0, column])
        heights = [v if v is not None else 0.0 for v in values]
        if huge:  # one line per pod in one collection: patches cost ~1 ms each to draw
            bars: Any = []  # no per-bar labels at this size
            ax.vlines(range(len(pods)), 0, heights, colors=colors, linewidth=0.6)
            ax.set_xlim(-0.5, len(pods) - 0.5)
        else:
            bars = ax.bar(range(len(pods)), heights, color=colors, edgecolor="black", lw=0.4)
        ax.axhline(limit, color="#d62728", linestyle="--", linewidth=1.5)
        top = max([*heights, limit]) * 1.25 or 1.0
        ax.set_ylim(0, top)
        ax.set_title(f"{label}\n(dashed: threshold {field} = {limit:g})", fontsize=10)
        ax.set_ylabel("nats")
        if huge:
            ax.set_xticks([])
            ax.set_xlabel(f"{len(pods)} pods, by name")
        else:
            ax.set_xticks(range(len(pods)))
            ax.set_xticklabels(
                names if not many else [""] * len(pods), rotation=45, ha="right", fontsize=8
            )
            for tick, color in zip(ax.get_xticklabels(), colors, strict=True):
                tick.set_color(color if color != NO_PROBE_COLOR else "black")
        ax.grid(axis="y", alpha=0.3)
        if not many:
            for bar, value, pod in zip(bars, values, pods, strict=True):
                if value is not None:
                    text, rotation = f"{value:.3g}", 0
                elif pod.probe:
                    text, rotation = f"{pod.probe.verdict.lower()}: no data", 90
                else:
                    text, rotation = "not probed", 90
                ax.annotate(
                    text,
                    xy=(bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    rotation=rotation,
                    fontsize=7,
                )
    ax.legend(
        handles=[Patch(color=c, label=v) for v, c in VERDICT_COLORS.items()]
        + [Patch(color=NO_PROBE_COLOR, label="not probed")],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="probe verdict",
        title_fontsize=8,
    )

    windows = result_windows(pods) if windows is None else windows
    timeline = fig.add_subplot(grid[1, :])
    labels = _timeline(timeline, st, pods, windows)

    updated = f"{st.updated_pods}/{st.target_pods} updated"
    failed = f", {st.failed_pods} failed" if st.failed_pods else ""
    fig.suptitle(
        f"{title or 'WeightRefit'} — {st.phase}, {updated}{failed} — fleet {st.fleet or '?'}\n"
        + headline(st, windows),
        fontsize=13,
        x=0.01,
        ha="left",
    )
    if st.message:
        # A figure label, not free text at the bottom edge: the layout keeps room for it below
        # the timeline and its legend, wrapped to the figure's width.
        fig.supxlabel(
            textwrap.fill(st.message, MESSAGE_WIDTH), fontsize=9, style="italic", x=0.01,
            ha="left",
        )  # fmt: skip
    if not huge:  # a huge fleet's timeline is tall and unlabelled: nothing to fit
        _fit_legend(fig, timeline)
        _fit_labels(fig, timeline, labels)
    return fig


def _fit_legend(fig: Any, ax: Any) -> None:
    """Spread the timeline's legend over as many columns as keep it within the timeline's
    height: a few pods make a short timeline, and a one-column legend of every step would run
    past the figure's bottom, over the status message."""
    legend = ax.get_legend()
    if legend is None:
        return
    handles = list(legend.legend_handles)
    columns = 1
    for _ in range(4):
        fig.canvas.draw()  # lays the figure out: the sizes below are the saved ones
        tall = legend.get_window_extent().height
        room = ax.get_window_extent().height
        if tall <= room or columns >= len(handles):
            return
        rows = -(-len(handles) // columns)
        fit = max(1, int(rows * room / tall))  # the title's height makes this a bit short
        columns = min(len(handles), max(columns + 1, -(-len(handles) // fit)))
        legend = _step_legend(ax, handles, columns)


def _fit_labels(fig: Any, ax: Any, labels: Sequence[Any]) -> None:
    """Widen the timeline's x range until every pod's phase label ends inside the axes: a
    label past the right edge runs into the step legend beside it."""
    if not labels:
        return
    fig.canvas.draw()
    box = ax.get_window_extent()
    left, right = ax.get_xlim()
    need = right
    for label in labels:
        width = label.get_window_extent().width + LABEL_MARGIN * fig.dpi / 72
        usable = box.width - width
        x = label.xy[0]
        if usable <= 0:
            continue  # wider than the axes: no x range fits it
        # x must sit at (x - left) / (need - left) * box.width <= usable.
        need = max(need, left + (x - left) * box.width / usable)
    if need > right:
        ax.set_xlim(left, need)


def result_windows(pods: Sequence[api.PodResult]) -> dict[str, tuple[float, float | None]]:
    """Windows out of traffic from the pods' results alone: the outOfTrafficSeconds before
    each completionTime (second resolution). A pod still out has no figure: no window."""
    out: dict[str, tuple[float, float | None]] = {}
    for p in pods:
        end = times.epoch(p.completion_time)
        if p.out_of_traffic_seconds is not None and end is not None:
            out[p.name] = (end - p.out_of_traffic_seconds, end)
    return out


def record_windows(records: Mapping[str, Progress]) -> dict[str, tuple[float, float | None]]:
    """Windows out of traffic from the pods' records of the refit's passes (name -> progress):
    from left_traffic to finished when the pass put the pod back, open while it is out (the
    pass in flight, or ended with the pod left out). A pod the pass never took out (staging
    while it served) has no window."""
    out: dict[str, tuple[float, float | None]] = {}
    for name, p in records.items():
        if not p.left_traffic:
            continue
        back = traffic.pod_seconds(p)
        out[name] = (p.left_traffic, p.left_traffic + back if back is not None else None)
    return out


def headline(st: api.WeightRefitStatus, windows: Windows) -> str:
    """The title's second line: the refit's time out of traffic (status.outOfTraffic, or the
    windows when they measure more pods) and how many pods are still out."""
    drawn = traffic.summarize_seconds(
        (name, back - left if back is not None else None) for name, (left, back) in windows.items()
    )
    oot = drawn if drawn.pods > st.out_of_traffic.pods else st.out_of_traffic
    still = sum(back is None for _, back in windows.values())
    out = f", {still} still out" if still else ""
    if not oot.pods:
        return f"time out of traffic: no pod put back yet{out}"
    return (
        f"time out of traffic: worst {seconds(oot.worst_seconds)} ({oot.worst_pod}), "
        f"median {seconds(oot.median_seconds)} over {oot.pods} pod(s) put back{out}"
    )


def _timeline(
    ax: Any, st: api.WeightRefitStatus, pods: list[api.PodResult], windows: Windows
) -> list[Any]:
    """Steps of each pod laid end to end from its startTime; the rest until its completionTime
    is waiting (retries with backoff, the strategy holding it back). Behind them, shaded, the
    pod's window out of traffic. One bar call per step for the whole fleet, so 10,000 pods
    draw in seconds. Returns each pod's phase label (none above LABELLED_ROWS pods)."""
    from matplotlib.patches import Patch

    starts = [t for t in (times.parse(p.start_time) for p in pods) if t is not None]
    origin = times.parse(st.start_time) or (min(starts) if starts else None)
    huge = len(pods) > LABELLED_ROWS
    # In points; the timeline is 0.28 in * LABELLED_ROWS tall when the fleet is that large.
    row_points = max(0.3, 0.28 * LABELLED_ROWS * 72 / len(pods) * 0.8)
    steps = [*STEPS, *sorted({s for p in pods for s in p.step_seconds} - set(STEPS))]
    lefts: list[float] = []
    for pod in pods:
        begin = times.parse(pod.start_time)
        lefts.append((begin - origin).total_seconds() if begin and origin else 0.0)
    ends = list(lefts)
    used: list[str] = []
    for step in steps:
        rows = [i for i, pod in enumerate(pods) if pod.step_seconds.get(step)]
        if not rows:
            continue
        widths = [pods[i].step_seconds[step] for i in rows]
        color = STEP_COLORS.get(step, "#dddddd")
        starts_at = [ends[i] for i in rows]
        if huge:  # one collection per step, each pod a line as thick as its row
            stops = [a + w for a, w in zip(starts_at, widths, strict=True)]
            ax.hlines(rows, starts_at, stops, colors=color, linewidth=row_points)
        else:
            ax.barh(rows, widths, left=starts_at, height=0.6, color=color, ec="white", lw=0.5)
        for i, w in zip(rows, widths, strict=True):
            ends[i] += w
        used.append(step)
    waits = []
    for row, pod in enumerate(pods):
        end = times.parse(pod.completion_time)
        if end and origin and (end - origin).total_seconds() > ends[row]:
            waits.append((row, ends[row], (end - origin).total_seconds()))
            ends[row] = (end - origin).total_seconds()
    if waits:
        ax.hlines([w[0] for w in waits], [w[1] for w in waits], [w[2] for w in waits],
                  color="#888888", lw=1 if not huge else 0.3, ls=":")  # fmt: skip
    shaded = _out_of_traffic(ax, pods, windows, origin, ends, huge, row_points)
    labels = []
    if not huge:
        for row, pod in enumerate(pods):
            label = pod.phase + (f": {pod.reason}" if pod.reason else "")
            if pod.phase not in ("Succeeded",) and pod.step:
                label += f" (at {pod.step})"
            bad = pod.phase in ("Failed", "Inconclusive")
            annotation = ax.annotate(
                label,
                xy=(max(ends[row], lefts[row]), row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color=VERDICT_COLORS["Fail"] if bad else "black",
            )
            labels.append(annotation)
        ax.set_yticks(range(len(pods)))
        ax.set_yticklabels([p.name for p in pods], fontsize=8)
    else:
        ax.set_yticks([])
        ax.set_ylabel(f"{len(pods)} pods, by name")
        ax.set_ylim(-0.5, len(pods) - 0.5)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the refit started")
    ax.set_title("per-pod step timeline", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    left, right = ax.get_xlim()
    ax.set_xlim(min(left, 0), right)  # the phase labels' room: _fit_labels, once laid out
    handles = [Patch(color=STEP_COLORS.get(s, "#dddddd"), label=s) for s in used] + shaded
    if handles:  # a refit that failed before any step has nothing to explain
        _step_legend(ax, handles)
    return labels


def _step_legend(ax: Any, handles: Sequence[Any], columns: int = 1) -> Any:
    """The timeline's legend, beside it at the top (replacing any legend it had)."""
    return ax.legend(
        handles=list(handles),
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        title="step",
        title_fontsize=8,
        ncols=columns,
    )


def _out_of_traffic(
    ax: Any,
    pods: list[api.PodResult],
    windows: Windows,
    origin: Any,
    ends: list[float],
    huge: bool,
    row_points: float,
) -> list[Any]:
    """Shade each pod's window out of traffic behind its steps (an open window reaches the end
    of the pod's timeline, hatched); the legend entries for what was drawn."""
    from matplotlib.patches import Patch

    if origin is None or not windows:
        return []
    zero = origin.timestamp()
    closed: list[tuple[int, float, float]] = []
    still: list[tuple[int, float, float]] = []
    for row, pod in enumerate(pods):
        if pod.name not in windows:
            continue
        left, back = windows[pod.name]
        start = left - zero
        if back is not None:
            closed.append((row, start, max(back - left, 0.0)))
        else:
            still.append((row, start, max(ends[row] - start, 0.0)))
    legend = []
    for group, hatch, label in ((closed, None, "out of traffic"), (still, "//", "still out")):
        if not group:
            continue
        rows, starts, widths = ([g[i] for g in group] for i in range(3))
        if huge:
            stops = [a + w for a, w in zip(starts, widths, strict=True)]
            color = OUT_OF_TRAFFIC_COLOR if hatch is None else STILL_OUT_EDGE
            ax.hlines(rows, starts, stops, colors=color, linewidth=row_points, zorder=0.5)
        else:
            ax.barh(rows, widths, left=starts, height=0.9, color=OUT_OF_TRAFFIC_COLOR,
                    hatch=hatch, edgecolor=STILL_OUT_EDGE if hatch else OUT_OF_TRAFFIC_COLOR,
                    lw=0, zorder=0.5)  # fmt: skip
        legend.append(
            Patch(facecolor=OUT_OF_TRAFFIC_COLOR, hatch=hatch, edgecolor=STILL_OUT_EDGE, lw=0,
                  label=label)
        )  # fmt: skip
    return legend


async def _fetch(
    name: str, namespace: str, kubeconfig: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]] | str]:
    """The WeightRefit, and its fleet's Pod objects (or why they could not be listed)."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    from ..edges.cluster import connect, read_json

    api_client = await connect(kubeconfig)
    async with api_client:
        doc: dict[str, Any] = await client.CustomObjectsApi(
            api_client
        ).get_namespaced_custom_object(API_GROUP, api.VERSION, namespace, api.PLURAL, name)
        selector = api.LabelSelector.model_validate(doc["spec"]["fleet"]["selector"])
        try:
            resp = await client.CoreV1Api(api_client).list_namespaced_pod(
                namespace, label_selector=selector.canonical(), _preload_content=False
            )
            items: list[dict[str, Any]] = (await read_json(resp)).get("items", [])
        except ApiException as e:
            return doc, f"HTTP {e.status} {e.reason}"
    return doc, items


def render_refit(
    doc: Mapping[str, Any],
    out: Path,
    pods: Sequence[Mapping[str, Any]] | None = None,
    *,
    title: str = "",
) -> Path:
    """Draw a whole WeightRefit object (metadata, spec and status). pods: the fleet's Pod
    objects as the API server returns them: every pod is drawn, from its own record (progress
    annotation) and status.pods; None draws only the pods status.pods lists (those that need
    attention)."""
    meta = doc.get("metadata", {})
    spec = doc.get("spec", {})
    thresholds = spec.get("probe", {}).get("thresholds")
    version = version_of(doc)
    title = title or f"WeightRefit {meta.get('namespace', '?')}/{meta.get('name', '?')} → {version}"
    status = doc.get("status") or {}
    results = None
    windows = None
    if pods is not None:
        from ..core.status import fleet_results

        listed = api.WeightRefitStatus.model_validate(dict(status)).pods
        views = pod_views(doc, pods)
        uid = str(meta.get("uid", ""))
        results = fleet_results(listed, views, uid)
        records = {v.name: v.progress for v in views if v.progress and v.progress.uid == uid}
        # A pod's own record where it has one; the status entry of a pod that left the fleet.
        windows = {**result_windows(results), **record_windows(records)}
    return render(status, out, thresholds=thresholds, title=title, pods=results, windows=windows)


def render_grpo(run: Mapping[str, Any], out: Path, *, title: str = "") -> Path:
    """Draw a GRPO run through Refit as a PNG at `out`: the reward per step above, each
    step's time below (publish, the operator's refit, generation), stacked.

    run: {"records": [StepRecord as a dict, one per publish], "steps": {step: {"reward":
    ...}}, "end": {"phase": ...}}, as testbed/grpo_trainer.py writes it. The last publish
    (the final weights, from on_train_end) has no rollouts: no reward, no generation.
    """
    records = sorted(run.get("records") or [], key=lambda r: int(r["step"]))
    if not records:
        raise ValueError("the run document has no steps (no records): nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in records]
    # JSON turns the steps' integer keys into strings.
    scored = {int(k): v for k, v in (run.get("steps") or {}).items()}
    rewarded = [
        (s, scored[s]["reward"]) for s in steps if scored.get(s, {}).get("reward") is not None
    ]

    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 7), height_ratios=[1, 1.3], layout="constrained"
    )
    if rewarded:
        values = [r for _, r in rewarded]
        top.plot([s for s, _ in rewarded], values, marker="o", color="#9467bd", clip_on=False)
        top.set_ylim(bottom=min(0.0, *values))  # a reward of 0 sits on the axis
    else:
        top.text(0.5, 0.5, "no reward logged", transform=top.transAxes, ha="center")
    top.set_ylabel("mean reward")
    top.set_title("reward of the step's rollouts", fontsize=10)
    top.grid(alpha=0.3)

    below = [0.0] * len(records)
    for key, label, color in GRPO_TIMES:
        values = [float(r.get(key) or 0.0) for r in records]
        bottom.bar(steps, values, bottom=below, color=color, label=label, edgecolor="black", lw=0.4)
        below = [b + v for b, v in zip(below, values, strict=True)]
    for step, total in zip(steps, below, strict=True):
        bottom.annotate(
            f"{total:.1f}s", xy=(step, total), xytext=(0, 2), textcoords="offset points",
            ha="center", va="bottom", fontsize=8,
        )  # fmt: skip
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("training step (the last refit publishes the final weights)")
    bottom.set_title("time per step: the refit to the step's weights, then its rollouts",
                     fontsize=10)  # fmt: skip
    bottom.set_xticks(steps)
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    bottom.grid(axis="y", alpha=0.3)

    end = (run.get("end") or {}).get("phase") or "not ended"
    fig.suptitle(
        f"{title or 'GRPO through Refit'} — {records[0]['version']} … {records[-1]['version']}"
        f" — {len(records)} refits, training {end}",
        fontsize=12, x=0.01, ha="left",
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refit_operator.tools.report",
        description="Render a PNG report of one WeightRefit: probe results and step timeline.",
    )
    p.add_argument("--refit", required=True, help="WeightRefit name")
    p.add_argument("-n", "--namespace", required=True)
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster, else KUBECONFIG")
    p.add_argument("--out", type=Path, default=Path("report.png"))
    args = p.parse_args(argv)
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        doc, pods = asyncio.run(_fetch(args.refit, args.namespace, args.kubeconfig))
    except ApiException as e:
        print(
            f"report: cannot read WeightRefit {args.namespace}/{args.refit}: "
            f"HTTP {e.status} {e.reason}",
            file=sys.stderr,
        )
        return 1
    if isinstance(pods, str):
        print(
            f"report: cannot list the fleet's pods ({pods}): drawing only the pods "
            "status.pods lists (those that need attention)",
            file=sys.stderr,
        )
    try:
        path = render_refit(doc, args.out, None if isinstance(pods, str) else pods)
    except ValueError as e:
        print(f"report: {args.namespace}/{args.refit}: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
