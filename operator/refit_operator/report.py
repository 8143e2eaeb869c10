"""A picture of one refit instead of a log: per-pod probe results and a per-pod step timeline.

    python -m refit_operator.report --refit NAME -n NAMESPACE [--kubeconfig PATH] --out report.png

reads the WeightRefit from the API server; `render(status, out, ...)` draws from a status dict
(`.status` of a WeightRefit) directly. Needs matplotlib (the `report` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from . import api
from .podflow import STEPS

VERDICT_COLORS: Final = {"Pass": "#2e9e44", "Fail": "#d62728", "Inconclusive": "#ff9f1c"}
NO_PROBE_COLOR: Final = "#b0b0b0"
# One color per step of the sequence, in order (tab10 + one).
STEP_COLORS: Final = dict(
    zip(
        STEPS,
        (
            "#1f77b4",
            "#aec7e8",
            "#9467bd",
            "#17becf",
            "#ff7f0e",
            "#c5b0d5",
            "#8c564b",
            "#e377c2",
            "#2ca02c",
            "#7f7f7f",
        ),
        strict=True,
    )
)


def _time(text: str) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def render(
    status: Mapping[str, Any],
    out: Path,
    *,
    thresholds: Mapping[str, Any] | None = None,
    title: str = "",
) -> Path:
    """Draw the refit `status` (a WeightRefit .status dict) as a PNG at `out`.

    thresholds: spec.probe.thresholds (camelCase dict); the API defaults when None.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    st = api.WeightRefitStatus.model_validate(dict(status))
    th = api.Thresholds.model_validate(dict(thresholds or {}))
    pods = sorted(st.pods, key=lambda p: p.name)
    if not pods:
        raise ValueError("the refit status lists no pods: nothing to draw")

    names = [p.name for p in pods]
    # A probe that scored no tokens (inconclusive, garbage answers) measured nothing: its zeros
    # are defaults, not values.
    probed = [p.probe if p.probe and p.probe.tokens > 0 else None for p in pods]
    colors = [VERDICT_COLORS[p.probe.verdict] if p.probe else NO_PROBE_COLOR for p in pods]
    many = len(pods) > 24

    fig = plt.figure(figsize=(15, 5.5 + 0.28 * len(pods)), layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=[4.5, 1.2 + 0.28 * len(pods)])
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
        bars = ax.bar(range(len(pods)), heights, color=colors, edgecolor="black", linewidth=0.4)
        ax.axhline(limit, color="#d62728", linestyle="--", linewidth=1.5)
        top = max([*heights, limit]) * 1.25 or 1.0
        ax.set_ylim(0, top)
        ax.set_title(f"{label}\n(dashed: threshold {field} = {limit:g})", fontsize=10)
        ax.set_ylabel("nats")
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

    _timeline(fig.add_subplot(grid[1, :]), st, pods)

    updated = f"{st.updated_pods}/{st.target_pods} updated"
    failed = f", {st.failed_pods} failed" if st.failed_pods else ""
    fig.suptitle(
        f"{title or 'WeightRefit'} — {st.phase}, {updated}{failed} — fleet {st.fleet or '?'}",
        fontsize=13,
        x=0.01,
        ha="left",
    )
    if st.message:
        fig.text(0.01, 0.002, st.message, fontsize=9, style="italic", va="bottom")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _timeline(ax: Any, st: api.WeightRefitStatus, pods: list[api.PodResult]) -> None:
    """Steps of each pod laid end to end from its startTime; the rest until its completionTime
    is waiting (retries with backoff, the strategy holding it back)."""
    from matplotlib.patches import Patch

    starts = [t for t in (_time(p.start_time) for p in pods) if t is not None]
    origin = _time(st.start_time) or (min(starts) if starts else None)
    used: list[str] = []
    for row, pod in enumerate(pods):
        begin = _time(pod.start_time)
        x = (begin - origin).total_seconds() if begin and origin else 0.0
        first = x
        for step in (*STEPS, *sorted(set(pod.step_seconds) - set(STEPS))):
            seconds = pod.step_seconds.get(step)
            if not seconds:
                continue
            color = STEP_COLORS.get(step, "#dddddd")
            ax.barh(row, seconds, left=x, height=0.6, color=color, edgecolor="white", lw=0.5)
            if step not in used:
                used.append(step)
            x += seconds
        end = _time(pod.completion_time)
        if end and origin and (end - origin).total_seconds() > x:
            ax.plot([x, (end - origin).total_seconds()], [row, row], color="#888888", lw=1, ls=":")
            x = (end - origin).total_seconds()
        label = pod.phase + (f": {pod.reason}" if pod.reason else "")
        if pod.phase not in ("Succeeded",) and pod.step:
            label += f" (at {pod.step})"
        ax.annotate(
            label,
            xy=(max(x, first), row),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=VERDICT_COLORS["Fail"] if pod.phase in ("Failed", "Inconclusive") else "black",
        )
    ax.set_yticks(range(len(pods)))
    ax.set_yticklabels([p.name for p in pods], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the refit started")
    ax.set_title("per-pod step timeline", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    left, right = ax.get_xlim()
    ax.set_xlim(min(left, 0), right + (right - left) * 0.18)  # room for the phase labels
    ax.legend(
        handles=[Patch(color=STEP_COLORS.get(s, "#dddddd"), label=s) for s in used],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        title="step",
        title_fontsize=8,
    )


async def _fetch(name: str, namespace: str, kubeconfig: str | None) -> dict[str, Any]:
    from kubernetes_asyncio import client

    from .cluster import connect

    api_client = await connect(kubeconfig)
    async with api_client:
        doc: dict[str, Any] = await client.CustomObjectsApi(
            api_client
        ).get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    return doc


def render_refit(doc: Mapping[str, Any], out: Path) -> Path:
    """Draw a whole WeightRefit object (metadata, spec and status)."""
    meta = doc.get("metadata", {})
    spec = doc.get("spec", {})
    thresholds = spec.get("probe", {}).get("thresholds")
    version = spec.get("checkpoint", {}).get("version", "?")
    title = f"WeightRefit {meta.get('namespace', '?')}/{meta.get('name', '?')} → {version}"
    return render(doc.get("status") or {}, out, thresholds=thresholds, title=title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refit_operator.report",
        description="Render a PNG report of one WeightRefit: probe results and step timeline.",
    )
    p.add_argument("--refit", required=True, help="WeightRefit name")
    p.add_argument("-n", "--namespace", required=True)
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster, else KUBECONFIG")
    p.add_argument("--out", type=Path, default=Path("report.png"))
    args = p.parse_args(argv)
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        doc = asyncio.run(_fetch(args.refit, args.namespace, args.kubeconfig))
    except ApiException as e:
        print(
            f"report: cannot read WeightRefit {args.namespace}/{args.refit}: "
            f"HTTP {e.status} {e.reason}",
            file=sys.stderr,
        )
        return 1
    try:
        path = render_refit(doc, args.out)
    except ValueError as e:
        print(f"report: {args.namespace}/{args.refit}: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
