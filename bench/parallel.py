"""A tensor-parallel pod against a one-worker pod on the same checkpoint, in one run.

Each layout is one real vLLM CPU server started from the wide model's checkpoint W (the
tiny model's checkpoint is 3 MB, below the noise of a server's resident memory), and refitted
as the operator runs it (vllm_suites.staged_refit: the stage while the pod serves, then drain
.. stamp and the probe's scoring). Per rep: the time out of traffic (that window), and what
staging holds: the resident memory the stage adds to the pod's processes, and each worker's
own report (how it staged, within what share of the pod's budget).

Every worker of a tensor-parallel pod stages the whole checkpoint (each loads its own shard
from it), so the pod's staging budget (REFIT_STAGING_BUDGET_BYTES) is split between its
workers (docs/concepts.md, "Parallel layouts and multi-pod replicas"). The third layout shows
the split with a budget that one worker's copy fits and two do not: the pod stages from disk
rather than hold more than its budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refit_worker import checkpoint

from bench.results import Metric
from bench.vllm_suites import (
    WIDE,
    WIDE_QUICK,
    Log,
    SuiteOut,
    first_completion,
    median,
    probe_prompts,
    staged_refit,
    wide_model,
    worker_loop,
)
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import start_vllm_server

MIB = 2**20
# vLLM's CPU build binds each worker's threads to a NUMA node of its own and refuses two
# workers on a one-node machine; unbound, the workers share the cores. Every layout runs
# unbound, so the two differ only in their worker count.
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass(frozen=True)
class Layout:
    label: str
    tp: int
    budget_per_checkpoint: float | None = None  # the pod's budget over the checkpoint's size


LAYOUTS = (
    Layout("TP 1", 1),
    Layout("TP 2", 2),
    Layout("TP 2, budget 1.5 x checkpoint", 2, 1.5),
)


@dataclass
class Reps:
    window: list[float] = field(default_factory=list)  # s out of traffic
    stage: list[float] = field(default_factory=list)  # s staging, while serving
    staged_mib: list[float] = field(default_factory=list)  # RSS the stage added, all processes
    released_mib: list[float] = field(default_factory=list)  # RSS after the load, over before
    report: dict[str, Any] = field(default_factory=dict)  # a worker's refit_stage answer


def _run_layout(layout: Layout, reps: int, dims: dict[str, int], log: Log) -> Reps:
    wide = wide_model(ensure_tiny_model(), dims)
    ckpt = wide.allowed_root / "W"
    size = sum(f.stat().st_size for f in checkpoint.safetensors_files(ckpt))
    env = dict(ENV)
    if layout.budget_per_checkpoint is not None:
        env[checkpoint.STAGING_BUDGET_ENV] = str(int(size * layout.budget_per_checkpoint))
    out = Reps()
    prompts = probe_prompts()
    args = ["--tensor-parallel-size", str(layout.tp)]
    with start_vllm_server(wide, env=env, extra_args=args) as server:
        first_completion(server)
        with worker_loop(server) as (loop, w):
            loop.run_until_complete(w.load(str(ckpt), "warmup"))  # format switch, first load
            loop.run_until_complete(w.score_prompts(prompts))  # the first batch's own costs
            after_stage: list[int] = []

            async def staged() -> None:
                after_stage.append(server.rss_bytes())
                # Staging the staged path again answers from the stage (a few stats).
                out.report = await w.stage(str(ckpt))

            for i in range(reps):
                before = server.rss_bytes()
                t = loop.run_until_complete(
                    staged_refit(w, str(ckpt), f"w{i}", prompts, staged=staged)
                )
                out.window.append(t["window"])
                out.stage.append(t["stage"])
                out.staged_mib.append((after_stage[-1] - before) / MIB)
                out.released_mib.append((server.rss_bytes() - before) / MIB)
                log(
                    f"parallel [{layout.label}] #{i + 1}: out of traffic {t['window']:.2f}s "
                    f"(stage {t['stage']:.2f}s while serving); staging held "
                    f"{out.staged_mib[-1]:.0f} MiB, {out.released_mib[-1]:.0f} MiB after the "
                    f"load; staged {out.report.get('staged')} within "
                    f"{int(out.report.get('budgetBytes', 0)) / MIB:.0f} MiB per worker"
                )
    return out


def suite(quick: bool, log: Log) -> SuiteOut:
    dims = WIDE_QUICK if quick else WIDE
    reps = 2 if quick else 5
    wide = wide_model(ensure_tiny_model(), dims)
    size = sum(f.stat().st_size for f in checkpoint.safetensors_files(wide.allowed_root / "W"))
    runs = {layout.label: _run_layout(layout, reps, dims, log) for layout in LAYOUTS}
    one, two = runs["TP 1"], runs["TP 2"]
    ckpt_mib = size / MIB
    metrics: list[Metric] = []
    for layout in LAYOUTS:
        r = runs[layout.label]
        how = f"staged {r.report.get('staged')}, {r.report.get('podWorkers')} worker(s)"
        metrics += [
            Metric(f"{layout.label}: time out of traffic", r.window, "s",
                   note="drain .. stamp, then the probe's scoring (vllm_suites.staged_refit)"),
            Metric(f"{layout.label}: staging, while serving", r.stage, "s"),
            Metric(f"{layout.label}: memory the stage holds", r.staged_mib, "MiB",
                   note=f"resident memory added by the stage, all the pod's processes; "
                        f"checkpoint {ckpt_mib:.0f} MiB; {how}"),
            Metric(f"{layout.label}: memory after the load, over before the stage",
                   r.released_mib, "MiB",
                   note="what the pod holds after the load, over before the stage"),
        ]  # fmt: skip
    metrics += [
        Metric("TP 2 / TP 1: time out of traffic (medians, same run)",
               [median(two.window) / median(one.window)], "x"),
        Metric("TP 2 / TP 1: memory the stage holds (medians, same run)",
               [median(two.staged_mib) / median(one.staged_mib)], "x",
               note="each worker stages the whole checkpoint: about 2 expected"),
    ]  # fmt: skip
    small = runs[LAYOUTS[2].label]
    budget = size * (LAYOUTS[2].budget_per_checkpoint or 0)
    notes = [
        f"wide model {dims}, checkpoint {ckpt_mib:.0f} MiB; {reps} reps per layout, the "
        f"layouts one after another on one machine; every server {ENV}",
        f"{LAYOUTS[2].label}: the pod's budget {budget / MIB:.0f} MiB, each worker's share "
        f"{int(small.report.get('budgetBytes', 0)) / MIB:.0f} MiB: staged "
        f"{small.report.get('staged')} ({small.report.get('note', '')})",
    ]
    raw = {label: r.__dict__ for label, r in runs.items()}
    return metrics, raw, notes
