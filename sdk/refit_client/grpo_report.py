"""A picture of a training run through Refit instead of a log: the reward and the refit time
per step. `render_grpo(run, out)` draws it from the run document `testbed/grpo_trainer.py`
writes (the `refit[trl]` integration's StepRecords and the reward TRL logged). Needs
matplotlib (the `report` extra). One refit, pod by pod, is report's picture.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .report import DPI

# The parts of a GRPO step's time (StepRecord fields), stacked in this order.
GRPO_TIMES: Final = (
    ("publish_seconds", "publish (reference + send)", "#1f77b4"),
    ("operator_seconds", "operator (refit → Succeeded)", "#ff7f0e"),
    ("generation_seconds", "generation (rollouts)", "#2ca02c"),
)


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
