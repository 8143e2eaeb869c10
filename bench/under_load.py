"""Refits under live traffic against the same refits on an idle pod, in one run.

One real vLLM CPU server (the tiny model, ``--enable-scale-out`` for the token-in-token-out
endpoint a rollout worker speaks). Refit cycles with the operator's own step code
(vllm_suites.refit_cycle), alternating checkpoints A and B: first on the idle pod, then per
drain mode (wait, abort, keep) while the load generator (testbed/loadgen.py) keeps
``STREAMS`` requests of ``MAX_TOKENS`` tokens in flight, routed to the pod only while it is in
traffic (out from the drain until the probe passed, as its readiness condition would do).

Per mode: the pod's time out of traffic (the cycle minus the stage, which runs while the pod
serves), its ratio to the idle pod's, and the latency of the requests that ended during the
refits (p50, p99), against the latency of the same load with no refit. Aborted requests (abort;
with wait, the late arrivals: sent as the pod left traffic, reaching it paused) and requests
that finished on both versions (keep) are counted per refit. ``wait`` runs once more with
``drainDelaySeconds`` 1 (``DELAYED``): the pod serves a second after leaving traffic before the
drain pauses it, so late arrivals are served instead of aborted.
"""

from __future__ import annotations

import asyncio
import time
from statistics import median
from typing import Any

from refit_operator.core.api_spec import Sequence
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient

from bench.results import Metric
from bench.vllm_suites import Log, SuiteOut, first_completion, refit_cycle
from testbed.loadgen import LoadGenerator, Record, Target, latency_percentiles
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import VllmServer, start_vllm_server

MODES = ("wait", "abort", "keep")
DELAYED = "wait-delay1"  # drain wait with spec.sequence.drainDelaySeconds 1
# Each variant's name (in the metrics, the raw results, the versions) and its sequence.
VARIANTS: dict[str, dict[str, Any]] = {
    **{mode: {"drain_mode": mode} for mode in MODES},
    DELAYED: {"drain_mode": "wait", "drain_delay_seconds": 1},
}
LABELS = {DELAYED: "wait, drainDelaySeconds 1"}  # in the metrics' names
STREAMS = 4  # concurrent clients: below the server's --max-num-seqs 8, so none waits
MAX_TOKENS = 300  # about half a second of generation each on this machine
STEADY_SECONDS = 6.0  # the no-refit baseline of the load
SETTLE_SECONDS = 1.5  # load before each refit, so every stream has a request in flight


class Route:
    """The pod as a gateway sees it: a target while in traffic."""

    def __init__(self, server: VllmServer) -> None:
        self.target = Target("pod", server.base_url)
        self.in_traffic = True

    def __call__(self) -> tuple[Target, ...]:
        return (self.target,) if self.in_traffic else ()

    def set(self, in_traffic: bool) -> None:
        self.in_traffic = in_traffic


async def cycles(
    server: VllmServer, n: int, mode: str, route: Route, gen: LoadGenerator | None
) -> list[dict[str, Any]]:
    """n refit cycles in ``mode`` (a VARIANTS name); per cycle its out-of-traffic seconds
    and window."""
    tiny = ensure_tiny_model()
    out = []
    async with worker_client.session() as http:
        w = WorkerClient(server.base_url, http=http, admin_token=server.admin_token,
                         timeout=300.0)  # fmt: skip
        for i in range(n):
            ckpt = tiny.checkpoints["AB"[i % 2]]
            if gen is not None:
                await asyncio.sleep(SETTLE_SECONDS)
            began = time.time()
            seq = Sequence.model_validate(VARIANTS[mode])
            c = await refit_cycle(w, str(ckpt), f"{mode}-{ckpt.name}-{i}", seq, route.set)
            if c.verdict != "Pass":
                raise RuntimeError(f"{mode} cycle {i}: probe verdict {c.verdict}")
            out.append({"began": began, "ended": time.time(), "version": f"{mode}-{ckpt.name}-{i}",
                        "outOfTraffic": c.total - c.steps["stage"], "steps": c.steps})  # fmt: skip
    return out


def during(records: list[Record], runs: list[dict[str, Any]]) -> list[Record]:
    """The records that ended during a refit (or within its tail: requests it held)."""
    return [r for r in records if any(c["began"] <= r.end <= c["ended"] + 2.0 for c in runs)]


def suite(quick: bool, log: Log) -> SuiteOut:
    tiny = ensure_tiny_model()
    n = 2 if quick else 6
    raw: dict[str, Any] = {"streams": STREAMS, "maxTokens": MAX_TOKENS, "cycles": n}
    metrics: list[Metric] = []
    with start_vllm_server(tiny, extra_args=["--enable-scale-out"]) as server:
        first_completion(server)
        route = Route(server)
        asyncio.run(cycles(server, 2, "wait", route, None))  # warm-up: switches load format
        idle = asyncio.run(cycles(server, n, "wait", route, None))
        idle_out = [c["outOfTraffic"] for c in idle]
        raw["idle"] = idle
        log(f"under_load: idle pod, out of traffic median {median(idle_out):.3f}s")
        metrics.append(Metric("out of traffic, idle pod", idle_out, "s",
                              note="drain wait; the cycle minus the stage"))  # fmt: skip
        with LoadGenerator(route, streams=STREAMS, max_tokens=MAX_TOKENS, deadline_s=60) as gen:
            time.sleep(STEADY_SECONDS)
        steady = [r for r in gen.records if r.outcome == "ok"]
        p50, p99 = latency_percentiles(steady, 0.5, 0.99)
        raw["steady"] = {"requests": len(steady), "p50": p50, "p99": p99}
        metrics += [
            Metric("request latency p50, load without a refit", [p50], "s",
                   note=f"{STREAMS} streams of {MAX_TOKENS} tokens"),
            Metric("request latency p99, load without a refit", [p99], "s"),
        ]  # fmt: skip
        for mode in VARIANTS:
            label = LABELS.get(mode, mode)
            gen = LoadGenerator(route, streams=STREAMS, max_tokens=MAX_TOKENS, deadline_s=600)
            with gen:
                runs = asyncio.run(cycles(server, n, mode, route, gen))
            records = gen.records
            out = [c["outOfTraffic"] for c in runs]
            got = during(records, runs)
            lp50, lp99 = latency_percentiles(got, 0.5, 0.99)
            aborted = sum(r.outcome == "aborted" for r in records)
            crossed = sum(len(set(r.versions)) > 1 for r in records if r.outcome == "ok")
            broken = [r.to_json() for r in records if r.outcome in ("truncated", "timeout",
                                                                    "connection")]  # fmt: skip
            raw[mode] = {"cycles": runs, "aborted": aborted, "crossed": crossed,
                         "requests": len([r for r in records if r.pod]), "broken": broken,
                         "p50": lp50, "p99": lp99}  # fmt: skip
            log(f"under_load: {mode}: out of traffic median {median(out):.3f}s, latency p50 "
                f"{lp50:.3f}s p99 {lp99:.3f}s, aborted {aborted}, crossed {crossed}")  # fmt: skip
            metrics += [
                Metric(f"out of traffic under load, drain {label}", out, "s"),
                Metric(f"out of traffic under load / idle, drain {label} (medians)",
                       [median(out) / median(idle_out)], "x"),
                Metric(f"request latency p50 during refits, drain {label}", [lp50], "s",
                       note=f"{len(got)} requests ended during the {n} refits"),
                Metric(f"request latency p99 during refits, drain {label}", [lp99], "s"),
                Metric(f"requests aborted per refit, drain {label}", [aborted / n], "requests"),
                Metric(f"requests finished on two versions per refit, drain {label}",
                       [crossed / n], "requests"),
                Metric(f"requests cut, hung or refused a connection, drain {label}",
                       [float(len(broken))], "requests", "<= 0"),
            ]  # fmt: skip
    notes = [
        "One pod: while it is out of traffic the load has nowhere to go (its clients wait), "
        "as an AllAtOnce refit leaves a fleet. Latencies are of requests that ended during a "
        "refit; a request held by the drain (wait) or frozen (keep) counts the refit's time.",
    ]
    return metrics, raw, notes
