"""Suite `overhead`: what the operator adds to a refit, against the same pod-side work done
directly, in one run (issue 43: the refit sits on a synchronous RL step's critical path).

Samples alternate operator-driven and direct (which of the two goes first alternates too, so
neither always follows the other), after one of each not counted (first connections, first
loads); p50 and p90 of each side, their ratios, and where the operator side's time went.

1. Control-plane floor: 2 simulated pods that answer at once (testbed.simworker), the real
   operator on a real kube-apiserver + etcd (bench/scale.py's machinery). Operator-driven: the
   trainer-side client's ``RefitClient.submit`` + ``wait`` of a checkpoint refit, from the call
   to the return that saw Succeeded. Direct: the pod-side calls the operator's pass makes, made
   by this process straight to the same pods, both at once (``direct_pass``: the operator's own
   step code, then the probe and the vouch); the preflight's pod calls (refit_info and
   get_world_size on every pod, the reference read and scored on one) are timed apart.
2. Real vLLM CPU, 2 pods, broadcast (``--overhead-vllm-samples``, default 10, --quick 5; run
   it under ``flock /tmp/refit-vllm.lock``, or leave it out: ``--overhead-no-vllm``):
   operator-driven is ``RefitClient.broadcast`` (the ConfigMap and WeightRefit writes, the
   rounds, the refit-gloo send from this process, the wait for Succeeded); direct is one
   world of 3 (this process rank 0, the pods ranks 1 and 2, as the operator's one AllAtOnce
   round) with the same pod steps and the probe on both pods.
   The probe reference is computed once, before the samples, on neither side per refit (the
   operator's comes in the trainer's ConfigMap).

Where the operator side's time goes comes from what the operator already exposes: each pod's
progress annotation (``started``, ``finished``, ``step_seconds``), the WeightRefit's status
changes as the client's watch delivers them (ReceiversReady, Succeeded) and, for simulated
pods, the pods' own call logs (when each call arrived and how long the pod took), no trace
point in the operator. ``phases`` below names each phase and its bounds.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.results import Metric

Log = Callable[[str], None]
SuiteOut = tuple[list[Metric], dict[str, Any], list[str]]

FLOOR_PODS = 2
FLOOR_TARGET_MS = "<= 100"  # apply -> Succeeded seen by the client, p50 (issue 43)
RATIO_P50_TARGET = "<= 1.2"  # real vLLM broadcast, operator-driven / direct
RATIO_P90_TARGET = "<= 1.4"
FLOOR_SAMPLES = (10, 20)  # (--quick, default) per side
VLLM_SAMPLES = (5, 10)
REFIT_TIMEOUT = 120.0

# The pod calls of the operator's preflight (controller/preflight.py) in the simulator's call
# log: refit_info and get_world_size on every pod, the reference read and scored on one.
PREFLIGHT_CALLS = ("refit_info", "refit_probe_reference", "get_world_size")
# Post-transfer steps of a pass (core/sequences.STEPS after the load or the receive).
POST_STEPS = ("wakeKV", "resetCache", "stampVersion", "checksum", "probe", "ready")
PRE_STEPS = ("drain", "sleep", "wakeWeights")
CHECKPOINT_TRANSFER = ("stage", "load")  # the steps that move the weights, by source
BROADCAST_TRANSFER = ("receive",)


# ------------------------------------------------------------------ pure: numbers
def p90(samples: list[float]) -> float:
    """The 90th percentile, linear between the closest ranks (numpy's default); the p50 is
    statistics.median, as the table's median."""
    return statistics.quantiles(samples, n=10, method="inclusive")[-1]


@dataclass(frozen=True)
class Comparison:
    """p50 and p90 of the operator-driven and the direct samples of one run, and their ratios
    (operator / direct: the same percentile of each side)."""

    operator_p50: float
    operator_p90: float
    direct_p50: float
    direct_p90: float

    @property
    def ratio_p50(self) -> float:
        return self.operator_p50 / self.direct_p50

    @property
    def ratio_p90(self) -> float:
        return self.operator_p90 / self.direct_p90


def compare(operator: list[float], direct: list[float]) -> Comparison:
    return Comparison(
        statistics.median(operator), p90(operator), statistics.median(direct), p90(direct)
    )


def comparison_metrics(
    label: str,
    operator_ms: list[float],
    direct_ms: list[float],
    operator_target: str | None = None,
    ratio_targets: tuple[str | None, str | None] = (None, None),
    direct_note: str = "",
) -> list[Metric]:
    """The rows of one case: each side's samples (the table's median is their p50) and p90,
    and the two ratios. ``operator_target`` bounds the operator side's p50."""
    c = compare(operator_ms, direct_ms)
    return [
        Metric(f"{label}: operator-driven, p50", operator_ms, "ms", operator_target,
               note="apply -> Succeeded seen by the trainer-side client (RefitClient)"),
        Metric(f"{label}: operator-driven, p90", [c.operator_p90], "ms"),
        Metric(f"{label}: direct, p50", direct_ms, "ms", note=direct_note),
        Metric(f"{label}: direct, p90", [c.direct_p90], "ms"),
        Metric(f"{label}: operator-driven / direct, p50", [c.ratio_p50], "x", ratio_targets[0],
               note=f"{c.operator_p50:.1f} ms / {c.direct_p50:.1f} ms, same run, alternating"),
        Metric(f"{label}: operator-driven / direct, p90", [c.ratio_p90], "x", ratio_targets[1],
               note=f"{c.operator_p90:.1f} ms / {c.direct_p90:.1f} ms"),
    ]  # fmt: skip


# ------------------------------------------------------------------ pure: phases
@dataclass
class OperatorSample:
    """One operator-driven refit as the harness saw it (epoch seconds, this machine's clock,
    which the operator and the simulator share)."""

    began: float  # the client call
    ended: float  # the call returned (Succeeded seen)
    created: float = 0.0  # the first status the client read back (its writes done)
    ready_seen: float = 0.0  # ReceiversReady seen by the client (broadcast)
    sent: float = 0.0  # the trainer's send finished (broadcast)
    send_seconds: float = 0.0  # the send itself, from the sender's stats
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod -> progress
    calls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # pod -> call log

    @property
    def total_ms(self) -> float:
        return 1000 * (self.ended - self.began)


def _ms(a: float, b: float) -> float:
    return round(1000 * (b - a), 2)


def _step_ms(record: Mapping[str, Any], steps: tuple[str, ...]) -> float:
    """The sum of these steps' seconds in one pod's record, in ms."""
    return round(1000 * sum(float(record.get("step_seconds", {}).get(s, 0.0)) for s in steps), 2)


def phases(s: OperatorSample, transfer: tuple[str, ...]) -> dict[str, float]:
    """Where one operator-driven refit's time went, in ms; the phases tile ``total`` (the
    pass's own phases are the slowest pod's). ``transfer``: the steps that move the weights
    (stage and load; receive).

    - submit: the client's writes, until its first read of the status;
    - simulated pods only, from their call logs: submit -> first preflight call (the watch
      event reaching the operator, its first reconcile's reads), preflight (the first
      preflight call -> the last one answered: refit_info, the reference read and scored,
      get_world_size), preflight -> pass start (the first pod's record ``started``); without
      call logs the three are one phase, "preflight + decision";
    - claim + records: the first pass's start -> the last pass's end, less the last pod's
      steps: the passes' own time outside their steps (claim write, progress records, pod
      GETs) and the last pod's start lag;
    - pre-transfer steps, transfer, post-transfer steps: the step seconds of the pod whose
      pass ended last (a broadcast's receive includes the wait for its round and the
      trainer's send);
    - final reconcile: the last pod's pass ended -> Succeeded seen by the client.
    """
    recs = s.records
    started = min(float(r["started"]) for r in recs.values())
    finished = max(float(r["finished"]) for r in recs.values())
    created = s.created or s.began
    out = {"total": _ms(s.began, s.ended), "submit": _ms(s.began, created)}
    preflight = [
        c
        for calls in s.calls.values()
        for c in calls
        if c.get("step") in PREFLIGHT_CALLS
        or (c.get("step") in ("models", "completions") and float(c["at"]) < started)
    ]
    if preflight:
        first = min(float(c["at"]) for c in preflight)
        last = max(float(c["at"]) + float(c.get("seconds", 0)) for c in preflight)
        out["submit -> first preflight call"] = _ms(created, first)
        out["preflight"] = _ms(first, last)
        out["preflight -> pass start"] = _ms(last, started)
    else:
        out["preflight + decision"] = _ms(created, started)
    pass_ms = max(_ms(float(r["started"]), float(r["finished"])) for r in recs.values())
    slowest = max(recs.values(), key=lambda r: float(r["finished"]))  # Succeeded waits for it
    steps_ms = {
        "pre-transfer steps": _step_ms(slowest, PRE_STEPS),
        "transfer": _step_ms(slowest, transfer),
        "post-transfer steps": _step_ms(slowest, POST_STEPS),
    }
    out["claim + records"] = round(_ms(started, finished) - sum(steps_ms.values()), 2)
    out.update(steps_ms)
    for step in (*PRE_STEPS, *transfer, *POST_STEPS):  # beside the direct side's (step_rows)
        out[f"step: {step}"] = _step_ms(slowest, (step,))
    out["final reconcile"] = _ms(finished, s.ended)
    out["pass (slowest pod)"] = pass_ms
    if s.calls:
        # What the pods themselves spent answering, over the whole refit: the rest is the
        # operator's and the API server's.
        out["pod time (slowest pod's calls)"] = round(
            max(1000 * sum(float(c.get("seconds", 0)) for c in calls)
                for calls in s.calls.values()),
            2,
        )  # fmt: skip
    if s.ready_seen:
        out["round: pass start -> ReceiversReady seen"] = _ms(started, s.ready_seen)
        if s.sent:
            out["round: ReceiversReady seen -> send began"] = _ms(
                s.ready_seen, s.sent - s.send_seconds
            )
            out["round: send"] = round(1000 * s.send_seconds, 2)
            out["round: send ended -> last pass ended"] = _ms(s.sent, finished)
    return out


def phase_metrics(label: str, per: list[dict[str, float]]) -> list[Metric]:
    """One row per phase: its ms in each operator-driven sample (the table shows the p50)."""
    return [
        Metric(f"{label}: operator phase: {n}", [p[n] for p in per if n in p], "ms")
        for n in per[0]
        if n != "total"
    ]


# ------------------------------------------------------------------ direct passes
async def direct_pass(
    w: Any,
    seq: Any,
    progress: Any,
    reference: Any,
    receive: Callable[[Any], Awaitable[Any]] | None = None,
) -> dict[str, float]:
    """One pod's pass as the operator runs it, made directly: its step code in STEPS order
    (sources.execute_step; ``receive(w)`` in place of the receive step of a broadcast), then
    the probe step's calls (the process identity, one scoring request for every prompt,
    judged by probe.evaluate, which must Pass) and the vouch. Seconds per step."""
    from refit_operator.controller import sources
    from refit_operator.controller.steps import mark_ready
    from refit_operator.core import probe, sequences
    from refit_operator.core.api_spec import Thresholds
    from refit_operator.core.sequences import Step

    from bench.vllm_suites import Laps

    lap = Laps()
    t_step = float(seq.step_timeout_seconds)
    for step in sequences.STEPS:
        if step in (Step.probe, Step.ready):
            continue
        if step == Step.receive:
            if receive is None:
                continue
            await w.world_size(timeout=t_step)  # the ranks the pod takes, as the pass asks
            await receive(w)
        else:
            await sources.execute_step(w, seq, progress, step, resumed=False)
        lap(step)
    process = await w.process_identity(timeout=t_step)
    scored = await w.score_prompts([list(p.token_ids) for p in reference.prompts],
                                   timeout=float(seq.probe_timeout_seconds))  # fmt: skip
    outcome = probe.evaluate(reference, scored, Thresholds())
    if outcome.verdict != "Pass":
        raise RuntimeError(f"direct pass {progress.version}: probe {outcome.verdict}")
    lap("probe")
    await mark_ready(w, progress.version, t_step, process)
    lap("ready")
    return lap.steps


async def direct_preflight(ws: list[Any], path: str | None, reference: Any, t_step: float) -> None:
    """The preflight's pod calls: refit_info and get_world_size on every pod, the reference
    (read from the checkpoint on the first pod when ``path``) scored on the first pod."""
    await asyncio.gather(*(w.refit_info(timeout=t_step) for w in ws))
    if path is not None:
        reference = await ws[0].probe_reference(path, timeout=t_step)
    await ws[0].score_prompts([list(p.token_ids) for p in reference.prompts], timeout=t_step)
    await asyncio.gather(*(w.world_size(timeout=t_step) for w in ws))


# ------------------------------------------------------------------ harness pieces
def _records(core: Any, ns: str, names: list[str]) -> dict[str, dict[str, Any]]:
    from refit_operator.core.podflow import PROGRESS_ANNOTATION

    out = {}
    for name in names:
        pod = core.read_namespaced_pod(name, ns)
        out[name] = json.loads((pod.metadata.annotations or {})[PROGRESS_ANNOTATION])
    return out


def _check_records(records: dict[str, dict[str, Any]], name: str) -> None:
    for pod, r in records.items():
        if r.get("refit") != name or r.get("outcome") != "Succeeded":
            raise RuntimeError(f"{name}: pod {pod} record {r.get('refit')} {r.get('outcome')}")


def _ready_round(status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "ReceiversReady" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _summary(label: str, log: Log, op: list[float], direct: list[float]) -> None:
    c = compare(op, direct)
    log(f"overhead: {label}: operator p50 {c.operator_p50:.1f} ms p90 {c.operator_p90:.1f} ms; "
        f"direct p50 {c.direct_p50:.1f} ms p90 {c.direct_p90:.1f} ms; ratio p50 "
        f"{c.ratio_p50:.2f} p90 {c.ratio_p90:.2f}")  # fmt: skip


async def alternate(
    n: int,
    label: str,
    log: Log,
    operator_side: Callable[[int], OperatorSample],
    direct_side: Callable[[int], Awaitable[dict[str, Any]]],
) -> tuple[list[OperatorSample], list[dict[str, Any]]]:
    """n samples of each side after one of each not counted (first connections, first
    loads), alternating; which side goes first alternates too, so neither always follows the
    other. The operator side (blocking client calls) runs in a thread."""
    ops: list[OperatorSample] = []
    directs: list[dict[str, Any]] = []
    for i in range(n + 1):
        for operator_turn in (True, False) if i % 2 == 0 else (False, True):
            if operator_turn:
                ops.append(await asyncio.to_thread(operator_side, i))
                log(f"overhead: {label} {i}: operator {ops[-1].total_ms:.1f} ms")
            else:
                directs.append(await direct_side(i))
                log(f"overhead: {label} {i}: direct {directs[-1]['pass_ms']:.1f} ms "
                    f"(preflight calls {directs[-1]['preflight_ms']:.1f} ms apart)")  # fmt: skip
    return ops[1:], directs[1:]


# ------------------------------------------------------------------ 1. the floor
def floor(n: int, log: Log) -> dict[str, Any]:
    from refit_client.client import RefitClient
    from refit_operator.core.api_spec import Sequence
    from refit_operator.core.podflow import start as pass_start
    from refit_operator.edges import worker_client
    from refit_operator.edges.worker_client import WorkerClient
    from refit_worker.contract import PROBE_FILE, ProbeReference

    from bench.scale import LABELS, control_plane, sim_fleet, stop
    from testbed.simworker import make_sim_checkpoint

    with control_plane("refit-bench-overhead-") as bench:
        ns = bench.cp.create_namespace("overhead")
        root = bench.work / "ckpt"
        root.mkdir()
        fleet = sim_fleet(FLOOR_PODS, root)
        sim = fleet.shards[0]
        names = [f"pod-{i}" for i in range(FLOOR_PODS)]
        proc = None
        try:
            bench.make_pods(ns, [p.ip for p in fleet.pods])
            proc = bench.start_operator(ns, "overhead")
            client = RefitClient(namespace=ns, kubeconfig=bench.cp.kubeconfig)
            seq = Sequence()

            def operator_side(i: int) -> OperatorSample:
                version = f"op-{i}"
                ckpt = make_sim_checkpoint(root / version, version)
                sim.call_logs(clear=True)
                s = OperatorSample(began=time.time(), ended=0.0)

                def seen(status: dict[str, Any]) -> None:
                    if not s.created:
                        s.created = time.time()

                name = client.submit(ckpt, version, fleet_selector=LABELS, port=fleet.port,
                                     strategy="AllAtOnce")  # fmt: skip
                client.wait(name, REFIT_TIMEOUT, on_update=seen)
                s.ended = time.time()
                s.records = _records(bench.core, ns, names)
                _check_records(s.records, name)
                logs = sim.call_logs()
                s.calls = {n: logs[p.ip] for n, p in zip(names, fleet.pods, strict=True)}
                return s

            async def run() -> tuple[list[OperatorSample], list[dict[str, Any]]]:
                async with worker_client.session() as http:
                    # As the operator calls pods that report CAP_ERRORS_KEEP_CONNECTION.
                    ws = [WorkerClient(p.base_url, http=http, timeout=60.0,
                                       keep_rpc_connections=True)
                          for p in fleet.pods]  # fmt: skip

                    async def direct_side(i: int) -> dict[str, Any]:
                        version = f"direct-{i}"
                        ckpt = make_sim_checkpoint(root / version, version)
                        reference = ProbeReference.from_json_dict(
                            json.loads((ckpt / PROBE_FILE).read_text())
                        )
                        t0 = time.perf_counter()
                        await direct_preflight(ws, str(ckpt), reference,
                                               float(seq.step_timeout_seconds))  # fmt: skip
                        t1 = time.perf_counter()
                        steps = await asyncio.gather(*(
                            direct_pass(w, seq, pass_start("bench", "bench", version, str(ckpt),
                                                           time.time()), reference)
                            for w in ws
                        ))  # fmt: skip
                        t2 = time.perf_counter()
                        return {"preflight_ms": 1000 * (t1 - t0), "pass_ms": 1000 * (t2 - t1),
                                "steps": steps}  # fmt: skip

                    return await alternate(n, "floor", log, operator_side, direct_side)

            op_samples, direct = asyncio.run(run())
            client.close()
        finally:
            if proc is not None:
                stop(proc)
            fleet.close()
    return {"operator": [phases(s, CHECKPOINT_TRANSFER) for s in op_samples], "direct": direct}


FLOOR = "floor, 2 simulated pods"


def floor_metrics(raw: Mapping[str, Any], log: Log | None = None) -> list[Metric]:
    """The floor's rows from its raw samples (``--reaggregate`` rebuilds them)."""
    per: list[dict[str, float]] = raw["operator"]  # each sample's phases
    direct = raw["direct"]
    op_ms = [p["total"] for p in per]
    pass_ms = [d["pass_ms"] for d in direct]
    with_preflight = [d["pass_ms"] + d["preflight_ms"] for d in direct]
    if log is not None:
        _summary("floor", log, op_ms, pass_ms)
    metrics = comparison_metrics(
        FLOOR, op_ms, pass_ms, operator_target=FLOOR_TARGET_MS,
        direct_note="each pod's pass (the operator's step code, the probe, the vouch), both "
        "pods at once, from this process",
    )  # fmt: skip
    metrics.append(Metric(f"{FLOOR}: direct incl. the preflight's pod calls", with_preflight,
                          "ms", note="refit_info, get_world_size, the reference read and "
                          "scored on one pod, then the passes"))  # fmt: skip
    metrics.append(Metric(
        f"{FLOOR}: operator-driven / direct incl. the preflight's pod calls, p50",
        [compare(op_ms, with_preflight).ratio_p50], "x"))  # fmt: skip
    return metrics + phase_metrics(FLOOR, per) + step_rows(FLOOR, direct, CHECKPOINT_TRANSFER)


# ------------------------------------------------------------------ 2. real vLLM broadcast
def vllm_broadcast(n: int, log: Log) -> dict[str, Any]:
    from refit_client.client import RefitClient
    from refit_operator.controller.sources.broadcast import receive_broadcast
    from refit_operator.core.api_spec import Broadcast, Sequence
    from refit_operator.core.podflow import start as pass_start
    from refit_operator.edges import worker_client
    from refit_operator.edges.worker_client import WorkerClient
    from refit_worker import broadcast as wire

    from bench.grpo import HOSTS, PODS
    from bench.scale import control_plane, stop
    from testbed.fleet import ADMIN_SECRET, LABELS
    from testbed.grpo_trainer import rollout_pods
    from testbed.pods import register_pod
    from testbed.tiny_model import ensure_tiny_model
    from testbed.vllm_server import free_port

    tiny = ensure_tiny_model()
    # Two weight sets, B and A by turns: every refit, whichever side makes it, changes the
    # pods' weights.
    weights = [wire.load_tensors(tiny.checkpoints[k]) for k in ("B", "A")]
    refs: list[Any] = []
    refits = [0]

    def next_weights() -> tuple[dict[str, Any], Any]:
        k = refits[0] % 2
        refits[0] += 1
        return weights[k], refs[k]

    spec: dict[str, Any] = {"admin_token_secret": ADMIN_SECRET, "sequence": {"sleepLevel": 1},
                            "strategy": "AllAtOnce"}  # fmt: skip
    seq = Sequence.model_validate(spec["sequence"])
    t_step = float(seq.step_timeout_seconds)
    with (
        control_plane("refit-bench-overhead-vllm-") as bench,
        rollout_pods(tiny, HOSTS) as servers,
    ):
        ns = bench.cp.create_namespace("overhead-vllm")
        proc = None
        try:
            # As testbed.fleet.Fleet.add_server_pods, without its watcher polling the pods.
            token = base64.b64encode(servers[0].admin_token.encode()).decode()
            bench.core.create_namespaced_secret(
                ns, {"metadata": {"name": ADMIN_SECRET}, "data": {"token": token}}
            )
            for name, server in zip(PODS, servers, strict=True):
                register_pod(bench.core, ns, name, server.host, labels=LABELS,
                             image="vllm/vllm-openai:test")  # fmt: skip
            proc = bench.start_operator(ns, "overhead-vllm")
            client = RefitClient(namespace=ns, kubeconfig=bench.cp.kubeconfig)

            def operator_side(i: int) -> OperatorSample:
                tensors, ref = next_weights()
                s = OperatorSample(began=time.time(), ended=0.0)

                def seen(status: dict[str, Any]) -> None:
                    now = time.time()
                    s.created = s.created or now
                    if not s.ready_seen and _ready_round(status):
                        s.ready_seen = now

                def sent(_round: int, stats: Any) -> None:
                    s.sent, s.send_seconds = time.time(), float(stats.seconds)

                port = free_port("127.0.0.1")
                client.broadcast(
                    tensors, f"op-{i}", fleet_selector=LABELS, rendezvous=("127.0.0.1", port),
                    reference=ref, timeout=REFIT_TIMEOUT, name=f"op-{i}",
                    port=servers[0].port, on_update=seen, on_send=sent, **spec,
                )  # fmt: skip
                s.ended = time.time()
                s.records = _records(bench.core, ns, list(PODS))
                _check_records(s.records, f"op-{i}")
                return s

            async def run() -> tuple[list[OperatorSample], list[dict[str, Any]]]:
                async with worker_client.session() as http:
                    ws = [WorkerClient(s.base_url, http=http, admin_token=s.admin_token,
                                       api_key=s.api_key, timeout=300.0,
                                       keep_rpc_connections=True)
                          for s in servers]  # fmt: skip
                    # Both weight sets' references, read once from their checkpoints (a trainer
                    # computes its own): neither side computes one per refit.
                    for k in ("B", "A"):
                        refs.append(await ws[0].probe_reference(str(tiny.checkpoints[k])))

                    async def direct_side(i: int) -> dict[str, Any]:
                        version = f"direct-{i}"
                        tensors, reference = next_weights()
                        t0 = time.perf_counter()
                        manifest = wire.build_manifest(tensors)  # the trainer's, as broadcast()
                        port = free_port("127.0.0.1")
                        b = Broadcast.model_validate(
                            {"version": version,
                             "rendezvous": {"host": "127.0.0.1", "port": port},
                             "manifest": {"configMapRef": {"name": "bench"},
                                          "digest": manifest.digest},
                             "timeoutSeconds": 120}
                        )  # fmt: skip

                        def send() -> None:  # the trainer, rank 0 of the pods' one round
                            with wire.Sender(3, host="127.0.0.1", port=port,
                                             timeout_seconds=120) as sender:  # fmt: skip
                                sender.send(tensors)

                        def receiver(rank: int) -> Callable[[Any], Awaitable[Any]]:
                            return lambda w: receive_broadcast(
                                w, b, manifest.to_json_dict(), rank, 3, version, t_step
                            )

                        trainer = asyncio.create_task(asyncio.to_thread(send))
                        try:
                            steps = await asyncio.gather(*(
                                direct_pass(w, seq, pass_start("bench", "bench", version, "",
                                                               time.time(), source="broadcast"),
                                            reference, receiver(rank))
                                for rank, w in enumerate(ws, start=1)
                            ))  # fmt: skip
                        finally:
                            await trainer
                        t1 = time.perf_counter()
                        await direct_preflight(ws, None, reference, t_step)
                        t2 = time.perf_counter()
                        return {"pass_ms": 1000 * (t1 - t0), "preflight_ms": 1000 * (t2 - t1),
                                "steps": steps}  # fmt: skip

                    return await alternate(n, "vllm", log, operator_side, direct_side)

            op_samples, direct = asyncio.run(run())
            client.close()
        finally:
            if proc is not None:
                stop(proc)
    return {"operator": [phases(s, BROADCAST_TRANSFER) for s in op_samples], "direct": direct}


VLLM = "real vLLM, 2 pods, broadcast"


def vllm_metrics(raw: Mapping[str, Any], log: Log | None = None) -> list[Metric]:
    """The real-vLLM case's rows from its raw samples (``--reaggregate`` rebuilds them)."""
    per: list[dict[str, float]] = raw["operator"]  # each sample's phases
    direct = raw["direct"]
    op_ms = [p["total"] for p in per]
    pass_ms = [d["pass_ms"] for d in direct]
    if log is not None:
        _summary("vllm broadcast", log, op_ms, pass_ms)
    metrics = comparison_metrics(
        VLLM, op_ms, pass_ms, ratio_targets=(RATIO_P50_TARGET, RATIO_P90_TARGET),
        direct_note="the trainer's manifest, one world of 3 (this process rank 0), each pod's "
        "pass with the operator's step code, the probe and the vouch, both pods at once",
    )  # fmt: skip
    metrics.append(Metric(f"{VLLM}: the preflight's pod calls, direct", [
        d["preflight_ms"] for d in direct], "ms",
        note="refit_info and get_world_size on both pods, the reference scored on one: what "
        "the operator's preflight asks of the pods; not in the direct samples"))  # fmt: skip
    return metrics + phase_metrics(VLLM, per) + step_rows(VLLM, direct, BROADCAST_TRANSFER)


def step_rows(label: str, direct: list[dict[str, Any]], transfer: tuple[str, ...]) -> list[Metric]:
    """The direct side's seconds per step, the slower pod's in each sample, in ms: beside the
    operator side's "operator phase: step: ..." rows, where the two sides' pod work differs."""
    return [
        Metric(f"{label}: direct step: {step}",
               [1000 * max(float(pod.get(step, 0.0)) for pod in d["steps"]) for d in direct], "ms")
        for step in (*PRE_STEPS, *transfer, *POST_STEPS)
    ]  # fmt: skip


def metrics_of(raw: Mapping[str, Any]) -> list[Metric]:
    """Every row of a result's raw (floor, then the real-vLLM case where it ran)."""
    out = floor_metrics(raw["floor"]) if "floor" in raw else []
    return out + (vllm_metrics(raw["vllm"]) if "vllm" in raw else [])


def suite(quick: bool, log: Log, vllm_samples: int | None = None, vllm: bool = True) -> SuiteOut:
    n_floor = FLOOR_SAMPLES[0 if quick else 1]
    raw: dict[str, Any] = {"floor": floor(n_floor, log)}
    metrics = floor_metrics(raw["floor"], log)
    notes = [
        f"Floor: {n_floor} samples per side after one warm-up each, alternating; "
        "2 simulated pods (testbed.simworker, one process), the operator with its defaults "
        "(bench.scale.Bench.start_operator), a checkpoint refit (AllAtOnce, sleep level 1).",
        "Phases (operator side, p50 over the samples, ms): from each pod's progress "
        "annotation, the client's status events and the simulated pods' call logs; "
        "'claim + records' is the slowest pod's pass minus its steps' own seconds.",
    ]
    if vllm:
        n = vllm_samples or VLLM_SAMPLES[0 if quick else 1]
        raw["vllm"] = vllm_broadcast(n, log)
        metrics += vllm_metrics(raw["vllm"], log)
        notes.append(
            f"Real vLLM: {n} samples per side after one warm-up each, alternating; 2 tiny-model "
            "vLLM CPU servers (refit-gloo, a core each), sleep level 1, AllAtOnce; the two "
            "weight sets (checkpoints B and A of the tiny model) alternate, so every refit "
            "changes the weights; the direct side's preflight calls are timed after its pass, "
            "outside its sample."
        )
    else:
        notes.append("Real vLLM case not run (--overhead-no-vllm).")
    return metrics, raw, notes
