"""A LoRA adapter refit against a refit of the full weights, on the same pod in one run.

One real vLLM CPU server with runtime LoRA updating, serving the bench's wide model (its
checkpoint W, about 480 MB: the tiny model's 3 MB reload is below the probe's own cost) and
the test bed's adapters built on W (testbed/tiny_adapter.py, rank 8 on q_proj and v_proj),
refitted alternately as the operator runs each pass with its own step code
(sources.execute_step):
- the full weights (vllm_suites.staged_refit of checkpoint W): the stage while the pod
  serves, then drain .. stamp and the probe's scoring, out of traffic;
- the adapter (sequences.ADAPTER_STEPS, v1 and v2 in turn): the adapter's check, its load under
  the staged name and the probe through it while the pod serves, then drain, swap, reset and
  the probe through the served name, out of traffic.
Per rep: the time out of traffic, and the whole pass. Both probes score one prompt per request
(PassContext.lora: a batch kills the LoRA-enabled CPU engine), so they differ only in the
work the pass does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from refit_operator.controller import sources
from refit_operator.controller.sources import adapter as adapter_source
from refit_operator.core import podflow, probe, sequences
from refit_operator.core.api_spec import Sequence, Thresholds
from refit_operator.core.sequences import Step
from refit_operator.edges.worker_client import WorkerClient

from bench.results import Metric
from bench.vllm_suites import (
    WIDE,
    WIDE_QUICK,
    Log,
    SuiteOut,
    first_completion,
    median,
    staged_refit,
    wide_model,
    worker_loop,
)
from testbed.tiny_adapter import TinyAdapters, ensure_tiny_adapters
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import start_vllm_server

SERVED = "policy"
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
# The window out of traffic starts at the drain: what runs before it, the pod serves through.
IN_TRAFFIC = sequences.ADAPTER_IN_TRAFFIC_STEPS


@dataclass
class Reps:
    window: list[float] = field(default_factory=list)  # s out of traffic
    probe: list[float] = field(default_factory=list)  # s of it the probe's scoring took
    total: list[float] = field(default_factory=list)  # s for the whole pass


async def adapter_refit(w: WorkerClient, adapters: TinyAdapters, version: str) -> dict[str, float]:
    """One adapter pass (sequences.ADAPTER_STEPS with the operator's step code); the probes
    score through the staged and the served name and must pass. Seconds: window, probe (the
    served probe's scoring, within the window), total."""
    seq = Sequence()
    path = str(adapters.dir(version))
    progress = podflow.start("bench", "bench", version, path, time.time(), source="adapter",
                             adapter=SERVED)  # fmt: skip
    reference = await w.probe_reference(path)
    prompts = [list(p.token_ids) for p in reference.prompts]
    began = time.perf_counter()
    left = began
    probed = 0.0
    for step in sequences.ADAPTER_STEPS:
        if step == Step.drain:
            left = time.perf_counter()
        if step in (Step.probeStaged, Step.probe):
            t = time.perf_counter()
            staged = podflow.staged_adapter_name(SERVED, version)
            model = staged if step == Step.probeStaged else SERVED
            scored = await w.score_prompts(prompts, model=model)
            outcome = probe.evaluate(reference, scored, Thresholds())
            if outcome.verdict != "Pass":
                raise RuntimeError(f"adapter {version}: {step}: {outcome.message}")
            if step == Step.probe:
                probed = time.perf_counter() - t
            else:  # as the operator's staged probe: nothing staged outlives it
                await adapter_source.unload_staged(w, progress, float(seq.step_timeout_seconds))
            continue
        await sources.execute_step(w, seq, progress, step, resumed=False)
    end = time.perf_counter()
    return {"window": end - left, "probe": probed, "total": end - began}


def suite(quick: bool, log: Log) -> SuiteOut:
    reps = 2 if quick else 5
    dims = WIDE_QUICK if quick else WIDE
    wide = wide_model(ensure_tiny_model(), dims)
    adapters = ensure_tiny_adapters(wide, base="W")
    ckpt = str(wide.allowed_root / "W")
    size = sum(f.stat().st_size for f in (wide.allowed_root / "W").glob("*.safetensors"))
    full, lora = Reps(), Reps()
    with start_vllm_server(wide, extra_args=LORA_ARGS, env=LORA_ENV) as server:
        first_completion(server)
        with worker_loop(server) as (loop, w):
            prompts = [list(p.token_ids) for p in adapters.reference("v1").prompts]
            loop.run_until_complete(w.load(ckpt, "warmup"))  # format switch, first load
            loop.run_until_complete(adapter_refit(w, adapters, "v1"))  # first load of LoRA
            for i in range(reps):
                began = time.perf_counter()
                t = loop.run_until_complete(
                    staged_refit(w, ckpt, f"a{i}", prompts, batch=False)
                )  # fmt: skip
                full.window.append(t["window"])
                full.probe.append(t["probe"])
                full.total.append(time.perf_counter() - began)
                a = loop.run_until_complete(adapter_refit(w, adapters, ("v2", "v1")[i % 2]))
                lora.window.append(a["window"])
                lora.probe.append(a["probe"])
                lora.total.append(a["total"])
                log(
                    f"adapter #{i + 1}: out of traffic {a['window']:.3f}s (pass "
                    f"{a['total']:.3f}s); full weights {full.window[-1]:.3f}s (pass "
                    f"{full.total[-1]:.3f}s)"
                )
    metrics = [
        Metric("adapter refit: time out of traffic", lora.window, "s",
               note="drain, swap, resetCache and the probe through the served name"),
        Metric("full refit: time out of traffic", full.window, "s",
               note="drain .. stamp (sleep, wake, reload), then the probe's scoring"),
        Metric("adapter refit: whole pass", lora.total, "s",
               note="with the check, the staged load and its probe while serving"),
        Metric("full refit: whole pass", full.total, "s", note="with the stage while serving"),
        Metric("adapter / full: time out of traffic (medians, same run)",
               [median(lora.window) / median(full.window)], "x"),
        Metric("adapter refit: out of traffic, the probe left out",
               [w - p for w, p in zip(lora.window, lora.probe, strict=True)], "s",
               note="drain, the swap (the files' digests again, load in place) and the reset"),
        Metric("full refit: out of traffic, the probe left out",
               [w - p for w, p in zip(full.window, full.probe, strict=True)], "s",
               note="drain, sleep, wake, the reload from the staged bytes, reset, stamp"),
        Metric("adapter / full: out of traffic, the probe left out (medians, same run)",
               [median([w - p for w, p in zip(lora.window, lora.probe, strict=True)])
                / median([w - p for w, p in zip(full.window, full.probe, strict=True)])], "x"),
    ]  # fmt: skip
    notes = [
        f"one vLLM CPU server ({' '.join(LORA_ARGS)}), wide model {dims} (checkpoint "
        f"{size / 2**20:.0f} MiB), adapters of rank 8; {reps} reps, adapter and full refits "
        "alternating; probes one prompt per request",
    ]
    return metrics, {"adapter": lora.__dict__, "full": full.__dict__}, notes
