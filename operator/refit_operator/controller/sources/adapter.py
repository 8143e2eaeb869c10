"""A LoRA adapter (spec.adapter), refitted beside the base weights without touching them: the
pass verifies the files, loads them under a staged name and probes them while the pod serves,
then swaps them in under the served name (docs/concepts.md, "LoRA adapters"). Its preflight
checks the adapter on every pod before any leaves traffic; a pod that joins later is checked
before its claim. Its record names the base it was probed on (core/gate.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import ClassVar

from ...core import admission, podflow
from ...core.api import Sequence, WeightRefitSpec
from ...core.gate import loaded
from ...core.podflow import NO_BASE, Progress, base_key
from ...core.podview import PodView
from ...core.reasons import Problem, Reason
from ...core.sequences import Source, Step
from ...edges.cluster import Kube
from ...edges.worker_client import WorkerClient, WorkerError
from ..pass_context import PassContext, StepCode, StepFailed, StepRun
from ..refit_state import Tick
from ..steps import drain_step, probe_step, ready_step, reset_cache_step
from .base import WeightSource

CHECK_CONCURRENCY = 64


# Each step is idempotent: a retried or resumed load first unloads the staged name it may
# already have loaded; the probes score through ``progress.probe_model``.
async def _check_adapter(run: StepRun) -> str:
    checked = await run.worker.adapter_check(run.progress.path, timeout=run.t_load)
    return f"adapter rank {checked.get('rank')}, {checked.get('bytes')} bytes verified"


async def _load_adapter(run: StepRun) -> str:
    p = run.progress
    staged = podflow.staged_adapter_name(p.adapter, p.version)
    await run.worker.unload_adapter(staged, timeout=run.t_step)
    await run.worker.load_adapter(staged, p.path, timeout=run.t_load)
    return ""


async def _probe_staged(run: StepRun) -> Progress:
    """The staged adapter's probe; once it passed, the staged name is unloaded at once: the
    swap loads the same files (checked again) under the served name, so nothing staged
    outlives this step, whatever fails after it (a drain, the swap, the served probe). A
    verdict that failed goes to the restore, which unloads it too."""
    judged = await probe_step(run)
    if judged.step == Step.drain:
        await _unload_staged(run)
    return judged


async def _swap_adapter(run: StepRun) -> str:
    # The files the staged probe judged, unchanged since (digests again; an adapter is small):
    # then in place under the served name, new weights loaded before the old go.
    p = run.progress
    await run.worker.adapter_check(p.path, timeout=run.t_load)
    await run.worker.load_adapter(p.adapter, p.path, inplace=True, timeout=run.t_load)
    return ""


async def unload_staged(worker: WorkerClient, progress: Progress, t_step: float) -> None:
    """Unload the pass's staged name (not loaded: fine), once its probe judged it."""
    staged = podflow.staged_adapter_name(progress.adapter, progress.version)
    await worker.unload_adapter(staged, timeout=t_step)


async def _unload_staged(run: StepRun) -> str:
    await unload_staged(run.worker, run.progress, run.t_step)
    return ""


async def _restore_adapter_step(run: StepRun) -> str:
    await restore_adapter(run.worker, run.seq, run.progress)
    return ""


async def restore_adapter(worker: WorkerClient, seq: Sequence, progress: Progress) -> None:
    """Refused before the swap: unload the staged name; the served adapter was never touched,
    and must still be listed for the pod to go on serving it."""
    t_step = float(seq.step_timeout_seconds)
    await worker.unload_adapter(
        podflow.staged_adapter_name(progress.adapter, progress.version), timeout=t_step
    )
    if progress.serving and progress.adapter not in await worker.adapters(timeout=t_step):
        raise StepFailed(
            progress.reason,
            f"{progress.message}; the pod no longer lists adapter {progress.adapter!r}",
            final=True,
        )


async def adapter_admission(
    client: WorkerClient,
    spec: WeightRefitSpec,
    pod: PodView,
    t_step: float,
    *,
    unreachable: bool = True,
) -> Problem | None:
    """Whether ``pod`` may take the refit's adapter, asked before it leaves traffic: the
    worker's refit_adapter_check (path rules, manifest and digests, a PEFT LoRA config vLLM
    serves, a rank within --max-lora-rank, target modules the served model has, matrices of its
    sizes), then the name against the models the pod serves (admission.adapter_name_problem).
    A refusal is the pod's problem, named; a pod that does not answer is PodUnreachable
    (``unreachable``; else None: the pass meets it again in its first step, with retries)."""
    adapter = spec.adapter
    assert adapter is not None
    try:
        await client.adapter_check(adapter.path, timeout=t_step)
        served = await client.served_models(timeout=t_step)
    except WorkerError as e:
        if e.kind == "rejected" and e.code:
            return Problem(e.code, f"pod {pod.name}: adapter {adapter.path}: {e.message}")
        if not unreachable:
            return None
        return Problem(
            Reason.PodUnreachable, f"pod {pod.name}: checking the adapter failed: {e.message}"
        )
    problem = admission.adapter_name_problem(
        adapter.name, served, ours=adapter.name in pod.adapter_records
    )
    if problem is not None:
        return Problem(problem.reason, f"pod {pod.name}: {problem.message}")
    return None


class FromAdapter(WeightSource):
    kind: ClassVar[Source] = "adapter"
    step_code: ClassVar[Mapping[Step, StepCode]] = {
        Step.stage: _check_adapter,  # verify the adapter's files: nothing to stage
        Step.loadAdapter: _load_adapter,
        Step.probeStaged: _probe_staged,
        Step.drain: drain_step,  # as for weights, without unloading adapters: it swaps one
        Step.swap: _swap_adapter,
        Step.resetCache: reset_cache_step,
        Step.probe: probe_step,
        Step.ready: ready_step,
        Step.restore: _restore_adapter_step,  # unload the staged name
    }

    def begin(self, ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
        """The base this adapter is probed on: the gate serves it on that base only."""
        progress = super().begin(ctx, pod, progress)
        base = pod.records.get("")
        if base is None:  # probed on weights no pass loaded: the first base pass unloads it
            return replace(progress, base_pass=NO_BASE)
        return replace(progress, base_version=loaded(base), base_pass=base_key(base))

    async def check(
        self, t: Tick, pods: list[PodView], cluster: Kube, client: Callable[[PodView], WorkerClient]
    ) -> Problem | None:
        """The adapter, checked on every pod before any pod is touched (adapter_admission);
        the first pod's problem by name, or None. Adapters are small: every pod verifies the
        files it would load."""
        sem = asyncio.Semaphore(CHECK_CONCURRENCY)
        t_step = float(t.view.spec.sequence.step_timeout_seconds)

        async def one(pod: PodView) -> Problem | None:
            async with sem:
                return await adapter_admission(client(pod), t.view.spec, pod, t_step)

        problems = await asyncio.gather(*map(one, pods))
        return next((p for p in problems if p is not None), None)

    async def admit(
        self, ctx: PassContext, pod: PodView, worker: WorkerClient, t_step: float
    ) -> Problem | None:
        # As the fleet preflight checked it on the others: before the claim takes the pod.
        return await adapter_admission(worker, ctx.spec, pod, t_step, unreachable=False)


ADAPTER = FromAdapter()
