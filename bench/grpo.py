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
"""

from __future__ import annotations

import asyncio
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


async def direct_refits(
    servers: list[VllmServer], tensors: dict[str, torch.Tensor], n: int, log: Log
) -> list[dict[str, Any]]:
    """n refits of every pod at once by the bench's broadcast cycle (after one not counted:
    the first gloo rendezvous of this process); per refit its wall time and each pod's steps."""
    out = []
    async with worker_client.session() as http:
        ws = [WorkerClient(s.base_url, http=http, admin_token=s.admin_token,
                           api_key=s.api_key, timeout=300.0) for s in servers]  # fmt: skip
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
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )  # fmt: skip
    metrics = grpo_metrics(steps, run["records"][0], [d["seconds"] for d in direct])
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
        f"of the direct refits {raw['loadavg_direct']}.",
    ]
    return metrics, raw, notes
