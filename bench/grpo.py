"""A GRPO run through Refit: how long each step waits for its new weights, against the same
refit made by direct calls to the same pods, in one run.

Two real vLLM CPU pods (testbed.grpo_trainer.rollout_pods) under the real operator on the
real API server (testbed.fleet.serving_fleet); testbed/grpo_trainer.py trains the tiny model
with TRL's GRPOTrainer through RefitRollout (broadcast from memory, AllAtOnce, one WeightRefit
per step, as tests/e2e/test_trl_training.py). Per step after the first, the turnaround: from
the end of the optimizer step until the step's first generate request goes to the pods at the
new version, split into the trainer's own work (TRL's logging and the next batch, until the
rollout function is entered), the publish (probe reference + broadcast send), the operator
(WeightRefit created -> Succeeded, less the send) and the rest (listing the Ready pods); then
the generation of the step's rollouts. Step 0, the start-up publish, is reported apart.

Then, against the same pods (the operator idle), the same refit by direct calls: the bench's
broadcast refit cycle (bench.broadcast.broadcast_cycle: the operator's step code through
WorkerClient, this process the trainer) on both pods at once, as AllAtOnce refits them, with
the same model's tensors (the tiny model's checkpoint B: the trainer's architecture, fp32,
the same bytes). The ratio: the operator-driven refit (publish + operator) over the direct one.

Then, on the same pods and operator, the same number of steps of TRL's AsyncGRPOTrainer
(testbed/async_grpo_trainer.py, as the async test in tests/e2e/test_trl_training.py: a sync
per optimizer step, each a Rolling keep WeightRefit, while RefitRolloutWorker generates): the
fleet's completion tokens per second during each refit against between refits (same run), the
wall time per optimizer step and the refit time per step of both integrations.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient
from refit_worker import broadcast as wire

from bench.broadcast import b_reference, broadcast_cycle
from bench.results import Metric, loadavg
from bench.scale import fresh_control_plane
from bench.vllm_suites import Log, SuiteOut
from testbed.fleet import serving_fleet
from testbed.grpo_trainer import rollout_pods, train
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import VllmServer

PODS = ("vllm-0", "vllm-1")
HOSTS = ("127.0.0.6", "127.0.0.7")


@dataclass(frozen=True)
class Turnaround:
    """One GRPO step's wait for its weights, in seconds, and its rollouts' generation."""

    step: int
    trainer_seconds: float  # optimizer step end -> rollout function entered (TRL's own work)
    publish_seconds: float  # probe reference + broadcast send
    operator_seconds: float  # WeightRefit created -> Succeeded, less the send
    rest_seconds: float  # Succeeded -> first generate request (listing the Ready pods)
    generation_seconds: float  # first generate request -> last completion

    @property
    def refit_seconds(self) -> float:
        """What the direct refit cycle does the same of: publish and operator."""
        return self.publish_seconds + self.operator_seconds

    @property
    def total_seconds(self) -> float:
        """Optimizer step end -> first generate request on the new version."""
        return self.trainer_seconds + self.refit_seconds + self.rest_seconds


def turnarounds(run: dict[str, Any]) -> list[Turnaround]:
    """The steps of a grpo_trainer document with an optimizer step before them and rollouts
    after them: not step 0 (the start-up publish) nor the final publish (on_train_end)."""
    ends = {int(k): v.get("optimizer_end_at") for k, v in run["steps"].items()}
    out = []
    for r in run["records"]:
        end, began, first = ends.get(r["step"]), r["publish_began_at"], r["first_request_at"]
        if end is None or first is None:
            continue
        publish, operator = r["publish_seconds"], r["operator_seconds"]
        out.append(Turnaround(
            step=r["step"], trainer_seconds=began - end, publish_seconds=publish,
            operator_seconds=operator, rest_seconds=first - began - publish - operator,
            generation_seconds=r["generation_seconds"],
        ))  # fmt: skip
    return out


def grpo_metrics(
    steps: list[Turnaround], startup: dict[str, Any], direct: list[float]
) -> list[Metric]:
    """The suite's rows: the turnaround per step and its parts, the start-up publish, the
    direct refit and the ratio of each step's operator-driven refit to the direct median."""
    if not steps:
        raise ValueError("no step with an optimizer step before it and rollouts after it")
    direct_median = statistics.median(direct)

    def per_step(field: str) -> list[float]:
        return [getattr(t, field) for t in steps]

    return [
        Metric("turnaround: optimizer step end -> first rollout request at the new version",
               per_step("total_seconds"), "s",
               note=f"steps {steps[0].step}-{steps[-1].step}; the sum of the four rows below"),
        Metric("turnaround: trainer (TRL's logging, next batch)", per_step("trainer_seconds"),
               "s"),
        Metric("turnaround: publish (reference + broadcast send)", per_step("publish_seconds"),
               "s"),
        Metric("turnaround: operator (WeightRefit created -> Succeeded, less the send)",
               per_step("operator_seconds"), "s"),
        Metric("turnaround: rest (listing the Ready pods)", per_step("rest_seconds"), "s"),
        Metric("generation of a step's rollouts (16 completions, 2 pods)",
               per_step("generation_seconds"), "s"),
        Metric("start-up publish + operator (step 0)",
               [startup["publish_seconds"] + startup["operator_seconds"]], "s",
               note="the first broadcast of the run: not in the rows above"),
        Metric("direct broadcast refit of both pods (bench refit cycle)", direct, "s",
               note="broadcast_cycle on each pod at once, this process the trainer"),
        Metric("operator-driven refit (publish + operator) / direct refit", [
            t.refit_seconds / direct_median for t in steps], "x",
               note="each step's over the direct refits' median, same run, same pods"),
    ]  # fmt: skip


def token_rate(finished: list[list[Any]], a: float, b: float) -> float:
    """Completion tokens per second of the completions (testbed.async_grpo_trainer's
    ``finished``: when, unit, served, tokens) that finished in [a, b)."""
    return sum(int(f[3]) for f in finished if a <= f[0] < b) / (b - a)


def keep_refit_throughput(
    syncs: list[dict[str, Any]], finished: list[list[Any]]
) -> tuple[list[float], list[float]]:
    """Completion tokens per second the fleet finished during each sync after the first (the
    worker runs through them), and in each gap between two of them."""
    windows = [(float(s["began"]), float(s["ended"])) for s in syncs[1:]]

    def rate(a: float, b: float) -> float:
        return token_rate(finished, a, b)

    during = [rate(a, b) for a, b in windows if b > a]
    gaps = itertools.pairwise(windows)
    between = [rate(x[1], y[0]) for x, y in gaps if y[0] > x[1]]
    if not during or not between:
        raise ValueError(f"too few syncs to compare: {len(syncs)}")
    return during, between


def step_walls(ends: list[float]) -> list[float]:
    """The wall time of each optimizer step after the first: the gaps between their ends."""
    return [b - a for a, b in itertools.pairwise(ends)]


def async_metrics(sync_run: dict[str, Any], async_run: dict[str, Any]) -> list[Metric]:
    """The async rows: fleet throughput during a Rolling keep refit over between refits (the
    async run), and per optimizer step the wall time and the refit time of each integration
    (a grpo_trainer and an async_grpo_trainer document, same pods)."""
    during, between = keep_refit_throughput(async_run["syncs"], async_run["finished"])
    quiet = async_run["steady"]
    # One-second slices of the steady window: samples comparable to a refit's.
    edges = [quiet["began"] + i for i in range(int(quiet["ended"] - quiet["began"]) + 1)]
    steady = [token_rate(quiet["finished"], a, b) for a, b in itertools.pairwise(edges)]
    if not steady:
        raise ValueError("the steady window is shorter than a second")
    steady_mean = sum(steady) / len(steady)
    sync_steps = sorted((int(k), v) for k, v in sync_run["steps"].items())
    sync_ends = [v["optimizer_end_at"] for _, v in sync_steps if "optimizer_end_at" in v]
    async_ends = [v["at"] for _, v in sorted((int(k), v) for k, v in async_run["steps"].items())]
    return [
        Metric("async: fleet completion tokens/s during a Rolling keep refit", during, "tok/s",
               note="each sync after the first: one pod out at a time, drainMode keep"),
        Metric("async: fleet completion tokens/s in steady state", steady, "tok/s",
               note="each second of the same worker generating after training: no refit, "
                    "the trainer idle"),
        Metric("async: throughput during a Rolling keep refit / steady state", [
            d / steady_mean for d in during], "x", note="each refit's over the steady mean"),
        Metric("async: fleet completion tokens/s between refits", between, "tok/s",
               note="each gap between two syncs: the trainer's step, sharing the 2 cores "
                    "with the pods"),
        Metric("wall per optimizer step: sync (GRPOTrainer, AllAtOnce)",
               step_walls(sync_ends), "s", note="optimizer step end to the next's"),
        Metric("wall per optimizer step: async (AsyncGRPOTrainer, Rolling keep)",
               step_walls(async_ends), "s", note="TRL's log of a step to the next's"),
        Metric("refit per step: sync (publish + operator)", [
            r["publish_seconds"] + r["operator_seconds"] for r in sync_run["records"][1:]],
               "s", note="every publish after the start-up one"),
        Metric("refit per step: async (reference + broadcast + refit, Rolling keep)", [
            s["ended"] - s["began"] for s in async_run["syncs"][1:]], "s",
               note="every sync after the cold one"),
    ]  # fmt: skip


async def direct_refits(
    servers: list[VllmServer], tensors: dict[str, torch.Tensor], n: int, log: Log
) -> list[dict[str, Any]]:
    """n refits of every pod at once by the bench's broadcast cycle (after one not counted:
    the first gloo rendezvous of this process); per refit its wall time and each pod's steps."""
    out = []
    async with worker_client.session() as http:
        ws = [WorkerClient(s.base_url, http=http, admin_token=s.admin_token,
                           api_key=s.api_key, timeout=300.0,
                           keep_rpc_connections=True) for s in servers]  # fmt: skip
        await b_reference(ws[0])  # read once, as the trainer's ConfigMap would carry it
        for i in range(n + 1):
            began = time.perf_counter()
            cycles = await asyncio.gather(*(broadcast_cycle(w, tensors, f"direct-{i}") for w in ws))
            wall = time.perf_counter() - began
            verdicts = [c.verdict for c, _ in cycles]
            if verdicts != ["Pass"] * len(ws):
                raise RuntimeError(f"direct refit {i}: probe verdicts {verdicts}")
            log(f"grpo: direct refit {i}{' (warm-up)' if i == 0 else ''}: {wall:.3f}s")
            if i > 0:
                out.append({"seconds": wall, "steps": [c.steps for c, _ in cycles]})
    return out


def suite(quick: bool, log: Log) -> SuiteOut:
    tiny = ensure_tiny_model()
    n_steps, n_direct = (3, 2) if quick else (7, 5)
    raw: dict[str, Any] = {"steps": n_steps}
    with (
        fresh_control_plane("refit-bench-grpo-") as (cp, work),
        rollout_pods(tiny, HOSTS) as servers,
        serving_fleet(cp, servers, PODS, "A", tiny.checkpoints["A"], namespace="grpo",
                      log_dir=work, timeout=180) as (fleet, _),
    ):  # fmt: skip
        raw["loadavg_training"] = loadavg()
        run = train(fleet, servers, tiny, work / "run.json", "--steps", str(n_steps))
        if run["end"] != {"phase": "Succeeded"}:
            raise RuntimeError(f"the GRPO run ended {run['end']}")
        raw["loadavg_async"] = loadavg()
        async_run = train(fleet, servers, tiny, work / "async.json", "--steps", str(n_steps),
                          "--prefix", "async", "--steady-seconds", "10",
                          module="testbed.async_grpo_trainer")  # fmt: skip
        if async_run["end"] != {"phase": "Succeeded"}:
            raise RuntimeError(f"the async GRPO run ended {async_run['end']}")
        steps = turnarounds(run)
        for t in steps:
            log(f"grpo: step {t.step}: turnaround {t.total_seconds:.3f}s (publish "
                f"{t.publish_seconds:.3f}s, operator {t.operator_seconds:.3f}s), generation "
                f"{t.generation_seconds:.3f}s")  # fmt: skip
        raw["loadavg_direct"] = loadavg()
        tensors = wire.load_tensors(tiny.checkpoints["B"])
        direct = asyncio.run(direct_refits(servers, tensors, n_direct, log))
    raw.update(
        records=run["records"], turnarounds=[asdict(t) for t in steps], direct=direct,
        async_syncs=async_run["syncs"], async_steps=async_run["steps"],
        async_steady_window=[async_run["steady"]["began"], async_run["steady"]["ended"]],
        async_consumption=async_run["consumption"],
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )  # fmt: skip
    metrics = grpo_metrics(steps, run["records"][0], [d["seconds"] for d in direct])
    metrics += async_metrics(run, async_run)
    notes = [
        f"{n_steps} GRPO steps of testbed/grpo_trainer.py (16 completions of 12 tokens per "
        "step), AllAtOnce, sleep level 1. Publish: the probe reference (a forward pass of "
        "the trainer's model) and the sender's time from its first byte to its last (the "
        "pods check every bucket as it arrives). Operator: the rest of the publish call, "
        "that is the trainer's manifest (BLAKE3 of every tensor), the WeightRefit's creation, "
        "the pods' drain, sleep, receive set-up, load, wake and probe, and the watch seeing "
        "Succeeded.",
        "Direct refit: two worlds of two (one per pod, both at once) where the operator's "
        "broadcast is one world of three; the tiny model is 3 MB, so both are bound by "
        "per-step overheads, not bytes.",
        f"Load average (1, 5, 15 min) at the start of training {raw['loadavg_training']}, "
        f"of the async run {raw['loadavg_async']}, of the direct refits "
        f"{raw['loadavg_direct']}.",
        f"Async: {n_steps} steps of testbed/async_grpo_trainer.py (16 samples a step, 8 "
        "completions of 12 tokens a group, max_staleness 2), Rolling maxUnavailable 1 with "
        "drainMode keep, sleep level 1; the worker's 2 threads each send one group at a time "
        "to the pods in traffic, so its throughput is the client's as much as the fleet's. "
        "Steady state: 10 s of the same worker, fresh, after training (same process, pods "
        "and version). Between refits the trainer computes on the same 2 cores as the pods "
        "(nice 10), which starves them: not a steady state. "
        "Its steps do not wait for rollouts the way the sync run's do: the sync wall per "
        "step includes generating the step's 16 completions.",
    ]
    return metrics, raw, notes
