"""Broadcast refits against checkpoint refits, and the broadcast transport against raw TCP.

1. One real vLLM CPU server with the refit-gloo engine, the tiny model, in one run: the
   operator's own step code for a checkpoint refit (vllm_suites.refit_cycle: stage, drain,
   sleep, wake, load, wake KV, reset, stamp, probe) and for a broadcast refit (the same steps
   with ``receive`` instead of stage and load: broadcast_source.receive_broadcast while this process
   sends as the trainer), alternating, timed per step. The pod's time out of traffic is the
   cycle minus the stage.
2. The transport alone, two processes on loopback: the trainer's Sender and one receiver that
   checks every tensor against the promise (refit_worker.broadcast.Verifier: BLAKE3 of every
   byte, as a pod does), against a plain TCP stream of the same number of bytes between two
   processes. Large enough to be bound by bytes, not by round trips.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
from refit_operator.controller import sources
from refit_operator.controller.sources import broadcast as broadcast_source
from refit_operator.core import podflow, probe, sequences
from refit_operator.core.api_spec import Broadcast, Sequence, Thresholds
from refit_operator.core.sequences import Step
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient
from refit_worker import broadcast as wire
from refit_worker.contract import TRANSFER_BACKEND, ProbeReference

from bench.results import Metric
from bench.vllm_suites import Cycle, Laps, Log, SuiteOut, first_completion, refit_cycle
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import free_port, start_vllm_server

TRANSPORT_MIB = 256  # the transport-only payload
TENSOR_MIB = 4  # per tensor of that payload (fp32)


# ------------------------------------------------------------------ refit cycles
def _send(port: int, tensors: dict[str, torch.Tensor], out: dict[str, Any]) -> None:
    """The trainer's side of one round (rank 0 of a world of 2)."""
    with wire.Sender(2, host="127.0.0.1", port=port, timeout_seconds=120) as sender:
        out["stats"] = sender.send(tensors).to_json_dict()


async def broadcast_cycle(
    w: WorkerClient, tensors: dict[str, torch.Tensor], version: str
) -> tuple[Cycle, dict[str, Any]]:
    """One pod's broadcast refit with the operator's step code, this process the trainer."""
    lap = Laps()
    manifest = wire.build_manifest(tensors)
    port = free_port("127.0.0.1")
    spec = Broadcast.model_validate(
        {"version": version, "rendezvous": {"host": "127.0.0.1", "port": port},
         "manifest": {"configMapRef": {"name": "bench"}, "digest": manifest.digest},
         "timeoutSeconds": 120}
    )  # fmt: skip
    lap("promise")
    progress = podflow.start("bench", "bench", version, "", time.time(), source="broadcast")
    seq = Sequence()
    record: dict[str, Any] = {}
    for step in sequences.STEPS:
        if step in (Step.probe, Step.ready):
            continue
        if step != Step.receive:
            await sources.execute_step(w, seq, progress, step, resumed=False)
        else:
            sent: dict[str, Any] = {}
            trainer = threading.Thread(target=_send, args=(port, tensors, sent))
            trainer.start()
            record = await broadcast_source.receive_broadcast(
                w, spec, manifest.to_json_dict(), 1, 2, version, float(seq.step_timeout_seconds)
            )
            await asyncio.to_thread(trainer.join)
            record["sent"] = sent.get("stats")
        lap(step)
    reference = await b_reference(w)
    scored = await w.score_prompts([list(p.token_ids) for p in reference.prompts])
    outcome = probe.evaluate(reference, scored, Thresholds())
    lap("probe")
    tokens = sum(len(p.token_ids) for p in reference.prompts)
    return Cycle(lap.steps, lap.total(), tokens, outcome.verdict), record


_REFERENCES: dict[str, ProbeReference] = {}


async def b_reference(w: WorkerClient) -> ProbeReference:
    """B's reference (the broadcast sends B): read once, from B's checkpoint on the pod (a
    trainer would send it in the WeightRefit's ConfigMap)."""
    if "B" not in _REFERENCES:
        _REFERENCES["B"] = await w.probe_reference(str(ensure_tiny_model().checkpoints["B"]))
    return _REFERENCES["B"]


def refit_cycles(quick: bool, log: Log) -> tuple[list[Metric], dict[str, Any]]:
    tiny = ensure_tiny_model()
    n = 3 if quick else 7
    tensors_b = wire.load_tensors(tiny.checkpoints["B"])
    config = json.dumps({"backend": TRANSFER_BACKEND})
    with start_vllm_server(
        tiny, load_format="safetensors", model_dir=tiny.checkpoints["A"],
        extra_args=["--weight-transfer-config", config],
    ) as server:  # fmt: skip
        first_completion(server)

        async def go() -> tuple[list[Cycle], list[Cycle], list[dict[str, Any]]]:
            files: list[Cycle] = []
            sends: list[Cycle] = []
            records: list[dict[str, Any]] = []
            async with worker_client.session() as http:
                w = WorkerClient(server.base_url, http=http, admin_token=server.admin_token,
                                 api_key=server.api_key, timeout=300.0)  # fmt: skip
                for i in range(n):
                    # A then B from files, then B by broadcast after A from files again:
                    # each broadcast replaces A's weights, as each file refit of B does.
                    await refit_cycle(w, str(tiny.checkpoints["A"]), f"A-{i}")
                    files.append(await refit_cycle(w, str(tiny.checkpoints["B"]), f"B-{i}"))
                    await refit_cycle(w, str(tiny.checkpoints["A"]), f"A2-{i}")
                    cycle, record = await broadcast_cycle(w, tensors_b, f"B-bcast-{i}")
                    sends.append(cycle)
                    records.append(record)
                    for c, what in ((files[-1], "file"), (cycle, "broadcast")):
                        if c.verdict != "Pass":
                            raise RuntimeError(f"{what} cycle {i}: probe verdict {c.verdict}")
                    log(f"broadcast: cycle {i}: file {files[-1].total:.3f}s, "
                        f"broadcast {cycle.total:.3f}s")  # fmt: skip
            return files, sends, records

        files, sends, records = asyncio.run(go())

    def window(c: Cycle) -> float:  # out of traffic: everything but the stage and promise
        return c.total - c.steps.get("stage", 0.0) - c.steps.get("promise", 0.0)

    nbytes = sum(t.numel() * t.element_size() for t in tensors_b.values())
    metrics = [
        Metric("refit cycle from files (tiny model)", [c.total for c in files], "s",
               note="stage, drain, sleep, wakes, load, reset, stamp, probe"),
        Metric("refit cycle by broadcast (tiny model)", [c.total for c in sends], "s",
               note="the same steps with receive instead of stage and load, trainer included"),
        Metric("out of traffic, files", [window(c) for c in files], "s"),
        Metric("out of traffic, broadcast", [window(c) for c in sends], "s"),
        Metric("out of traffic, broadcast / files",
               [window(b) / window(f) for b, f in zip(sends, files, strict=True)], "x"),
        Metric("load step (files) vs receive step (broadcast)",
               [s.steps["receive"] / f.steps["load"] for s, f in zip(sends, files, strict=True)],
               "x", note="receive: init, start, update (receive, check, load), finish, read-back"),
    ]  # fmt: skip
    raw = {
        "bytes": nbytes,
        "file_steps": [c.steps for c in files],
        "broadcast_steps": [c.steps for c in sends],
        "received": [
            {k: r.get(k) for k in ("receiveSeconds", "loadSeconds", "bytes", "sent")}
            for r in records
        ],
    }
    return metrics, raw


# ------------------------------------------------------------------ transport only
def _payload(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = TENSOR_MIB * 2**20 // 4
    return {f"t{i:04d}": torch.rand(per, generator=g) for i in range(mib // TENSOR_MIB)}


def _receiver(port: int, manifest: dict[str, Any] | None, out: Any) -> None:
    """One receiving rank; checks every tensor against the promise unless it is None."""
    from refit_worker.transfer_manifest import parse_manifest

    group = wire.Group("127.0.0.1", port, 1, 2, 120)
    began = time.perf_counter()
    if manifest is None:
        got = sum(t.numel() * t.element_size() for _, t in wire.receive(group))
        out.put((time.perf_counter() - began, True, got))
    else:
        verifier = wire.Verifier(parse_manifest(manifest))
        ok = all(verifier.check(name, t) for name, t in wire.receive(group))
        out.put((time.perf_counter() - began, ok and verifier.refusal() is None, verifier.bytes))
    group.close()


def _gloo(tensors: dict[str, torch.Tensor], manifest: dict[str, Any] | None, ctx: Any) -> float:
    """Bytes per second of one round to one receiver process, until it holds (and, with a
    manifest, has checked) every byte."""
    out = ctx.Queue()
    with wire.Sender(2, host="127.0.0.1", port=0, timeout_seconds=120) as sender:
        proc = ctx.Process(target=_receiver, args=(sender.port, manifest, out))
        proc.start()
        sender.connect()
        began = time.perf_counter()
        sender.send(tensors)
        _, ok, got = out.get(timeout=300)
        seconds = time.perf_counter() - began  # first byte sent -> receiver done
        proc.join(60)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if not ok or got != nbytes:
        raise RuntimeError(f"the receiver refused or missed bytes ({got} of {nbytes})")
    return nbytes / seconds


def _sink(port: int, nbytes: int, out: Any) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = bytearray(16 * 2**20)
        view = memoryview(buf)
        got = 0
        began = time.perf_counter()
        while got < nbytes:
            n = s.recv_into(view)
            if not n:
                break
            got += n
        out.put((time.perf_counter() - began, got))


def transport(quick: bool, log: Log) -> tuple[list[Metric], dict[str, Any]]:
    mib = 64 if quick else TRANSPORT_MIB
    tensors = _payload(mib)
    manifest = wire.build_manifest(tensors).to_json_dict()
    nbytes = mib * 2**20
    ctx = multiprocessing.get_context("spawn")
    gloo, unchecked, raw = [], [], []
    for i in range(3 if quick else 5):
        gloo.append(_gloo(tensors, manifest, ctx))
        unchecked.append(_gloo(tensors, None, ctx))
        # The same number of bytes through one plain TCP stream between two processes.
        with socket.create_server(("127.0.0.1", 0)) as listen:
            out = ctx.Queue()
            proc = ctx.Process(target=_sink, args=(listen.getsockname()[1], nbytes, out))
            proc.start()
            conn, _ = listen.accept()
            with conn:
                data = memoryview(bytearray(nbytes))
                began = time.perf_counter()
                conn.sendall(data)
                _, got = out.get(timeout=300)
                seconds = time.perf_counter() - began
            proc.join(60)
        if got != nbytes:
            raise RuntimeError(f"raw round {i}: the sink got {got} of {nbytes} bytes")
        raw.append(nbytes / seconds)
        log(f"broadcast: transport {i}: gloo+check {gloo[-1] / 2**20:.0f} MiB/s, gloo alone "
            f"{unchecked[-1] / 2**20:.0f} MiB/s, raw TCP {raw[-1] / 2**20:.0f} MiB/s")  # fmt: skip
    ratio = [g / r for g, r in zip(gloo, raw, strict=True)]
    metrics = [
        Metric(f"transport {mib} MiB: gloo broadcast + BLAKE3 check", [g / 2**20 for g in gloo],
               "MiB/s", note="trainer process -> one receiver process, loopback"),
        Metric(f"transport {mib} MiB: gloo broadcast, no check", [u / 2**20 for u in unchecked],
               "MiB/s", note="what the BLAKE3 check of every byte costs"),
        Metric(f"transport {mib} MiB: raw TCP stream", [r / 2**20 for r in raw], "MiB/s"),
        Metric("transport: broadcast / raw TCP", ratio, "x",
               note="with the check a pod makes (its target, >= 0.5, is retired)"),
        Metric("transport: broadcast without the check / raw TCP",
               [u / r for u, r in zip(unchecked, raw, strict=True)], "x"),
    ]  # fmt: skip
    return metrics, {"bytes": nbytes, "tensors": len(tensors)}


def suite(quick: bool, log: Log) -> SuiteOut:
    cycles, raw_cycles = refit_cycles(quick, log)
    moved, raw_transport = transport(quick, log)
    notes = [
        "The tiny model is 3 MB: its cycles are bound by per-request and per-step overheads, "
        "not bytes; the transport rows measure the bytes.",
        f"Transport rows: {Path(__file__).name}, a trainer process and a receiver process on "
        "loopback sharing the machine's 2 cores with each other (the receiver hashes every "
        "byte, as a pod does, before the next bucket).",
    ]
    return cycles + moved, {"cycles": raw_cycles, "transport": raw_transport}, notes
