"""The code of the steps the weight sources share (``WEIGHTS_STEP_CODE``: the drain in its mode,
sleep and wakes, the cache reset, the version stamp, the read-back, the probe, the vouch, the
restore); how the weights arrive (a checkpoint's stage and load, a broadcast's receive, an
adapter's load and swap) is each source's own (controller/sources/). Each step is one try: its
retries, records and events are the pass's (pod_pass.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from refit_worker import contract

from ..core import checksums, podflow, probe, sequences, times
from ..core.api import Sequence, Thresholds
from ..core.gate import gate, served
from ..core.podflow import Progress
from ..core.podview import PodView
from ..core.reasons import Reason
from ..core.sequences import Step
from ..edges import metrics
from ..edges.cluster import ClaimedPod, ClaimLost
from ..edges.worker_client import WorkerClient, WorkerError
from .pass_context import PassContext, StepCode, StepFailed, StepRun

DRAIN_POLL_SECONDS = 0.5
# A keep drain's count of what it froze: reads of /metrics this far apart, until two agree.
KEEP_SETTLE_SECONDS = 0.2
KEEP_SETTLE_READS = 5


async def drain_step(run: StepRun) -> str:
    if run.ctx is not None and run.pod is not None:
        await _wait_out_of_endpoints(run.ctx, run.pod, run.claimed)
    await _wait_drain_delay(run.seq, run.progress)
    # The record before it set the readiness condition False.
    return await _drain(run.worker, run.seq, run.progress.version)


async def _drain_weights(run: StepRun) -> str:
    """A weights pass's drain, which also unloads every LoRA adapter the pod's records name: an
    adapter was probed on the base it serves now, and vLLM keeps adapters across a reload.
    Their records stay: the gate reads them against the base this pass leaves (core/gate.py:
    on another version the adapter's track needs a refit; on the same, its target loads it
    again). An adapter someone else loaded (no record of its name) is theirs, left as it is."""
    note = await drain_step(run)
    if run.progress.lora and run.pod is not None:
        for name in sorted(run.pod.adapter_records):
            await run.worker.unload_adapter(name, timeout=run.t_step)  # not loaded: fine
    return note


async def _sleep(run: StepRun) -> str:
    # vLLM's sleep pauses the scheduler again, in its own mode: keep, so that the requests a
    # keep drain froze survive it; otherwise abort, so that anything queued since the drain
    # (sent through an endpoint that had not yet dropped the pod) is aborted, visibly, rather
    # than run on weights no probe has passed.
    mode = "keep" if run.seq.drain_mode == "keep" else "abort"
    await run.worker.sleep(run.seq.sleep_level, mode=mode, timeout=run.t_step)
    return ""


async def _wake_weights(run: StepRun) -> str:
    await run.worker.wake_up(["weights"], timeout=run.t_step)
    return ""


async def _wake_kv(run: StepRun) -> str:
    await _abort_late_arrivals(run)
    await run.worker.wake_up(["kv_cache"], timeout=run.t_step)
    return ""


async def _abort_late_arrivals(run: StepRun) -> None:
    """Before the scheduler resumes (vLLM's KV wake; the resetCache step's resume at sleep
    level 0), which comes before the probe: requests that reached the pod since the drain
    (a gateway that had not yet dropped it) wait in vLLM's queue and would run then, on
    weights no probe has passed. Abort them: vLLM's clean, retryable abort
    (tests/worker/test_late_arrivals.py). A keep drain's frozen requests are kept."""
    if run.seq.drain_mode != "keep":
        await run.worker.pause("abort", timeout=run.t_step)


async def reset_cache_step(run: StepRun) -> str:
    # A keep drain's frozen requests hold KV blocks computed on the old weights: vLLM refuses
    # the reset while they do, so they are preempted and recompute on the new.
    keep = run.seq.drain_mode == "keep"
    await run.worker.reset_prefix_cache(reset_running=keep, timeout=run.t_step)
    if not sequences.step_applies(Step.wakeKV, run.seq.sleep_level, run.progress.source):
        await _abort_late_arrivals(run)  # this resume is the first
    # Unpause so the probe can be served; the pod is still out of Service endpoints.
    await run.worker.resume(timeout=run.t_step)
    return ""


async def _stamp_version(run: StepRun) -> str:
    version = run.progress.version
    await run.worker.update_weight_version(version, timeout=run.t_step)
    got = await run.worker.weight_version(timeout=run.t_step)
    if got != version:
        raise StepFailed(Reason.VersionMismatch, f"pod reports {got!r}, expected {version!r}")
    return ""


async def _checksum(run: StepRun) -> str:
    got = await read_back(run.worker, run.t_step)
    if run.ctx is None or run.pod is None:
        return ""  # a step run alone: read back, judged by no peers
    ctx, pod, progress = run.ctx, run.pod, run.progress
    metrics.pod_checksum(ctx.namespace, ctx.fleet, pod.name, got.layout, got.digest)
    refused = checksums.judge(
        got,
        progress.version,
        ctx.recorded_checksum(progress.version, got.layout),
        ctx.readbacks.witnesses(progress.version, got.layout, pod.name),
    )
    run.progress = replace(progress, layout=got.layout, checksum=got.digest)
    if refused is not None:
        raise StepFailed(refused.reason, refused.message, final=True)
    return ""


async def probe_step(run: StepRun) -> Progress:
    ctx, pod = run.in_pass(Step(run.progress.step))
    return await _probe(ctx, pod, run.worker, run.progress)


async def ready_step(run: StepRun) -> str:
    # The probe passed: vouch for this process's weights, so its readiness probe passes
    # (refit_worker.readiness); the pass's last record then sets the condition True. Both
    # only if the gate lets the whole pod in: another track (a failed adapter, one missing)
    # may hold it out, and then nothing vouches.
    done = podflow.step_done(run.progress, Step.ready, 0.0, times.now())
    await _vouch(run, done, run.progress.process or None)
    return ""


async def _vouch(run: StepRun, record: Progress, process: str | None) -> None:
    """Vouch for the process's weights when the gate over the pod with ``record`` (the pass's
    last) lets it in; the version vouched for is the base weights' it serves."""
    if run.pod is None:  # a step run alone (the bench, tests): no pod to judge
        if not record.adapter:  # a weights pass vouches for its weights, as before
            await mark_ready(run.worker, record.version, run.t_step, process)
        return
    unit = run.pod.with_record(record)
    if gate(unit, focus=record.track).ready:
        version = served(unit.records[""])
        await mark_ready(run.worker, version, run.t_step, process)


async def _restore_step(run: StepRun) -> str:
    await _restore(run.worker, run.seq, run.progress)
    # Probed in this process by an earlier pass (no restart since), so vouched for already;
    # again, so that the condition's True never waits on a readiness probe that fails.
    await _vouch(run, podflow.restored(run.progress, times.now()), None)
    return ""


async def read_back(worker: WorkerClient, t_step: float) -> checksums.Readback:
    """What the pod's model holds now: vLLM's per-parameter digests (/weight_checker, through
    the guard with the pass's fencing token) and the extension's per-buffer digests."""
    parameters = await worker.weight_checksums(timeout=t_step)
    dtype, buffers = await worker.buffer_digests(timeout=t_step)
    if not parameters:
        raise StepFailed(Reason.WorkerProtocolError, "the weight checker read back no parameter")
    return checksums.read_back(dtype, parameters, buffers)


async def _restore(worker: WorkerClient, seq: Sequence, progress: Progress) -> None:
    """After a load refused before the model was touched: the pod serves what it served."""
    t_step = float(seq.step_timeout_seconds)
    if seq.sleep_level >= 2:
        raise StepFailed(
            progress.reason,
            f"{progress.message}; sleep level 2 discarded the weights {progress.serving} "
            "the pod served, so it stays out of traffic",
            final=True,
        )
    if seq.sleep_level == 1:
        await worker.wake_up(["kv_cache"], timeout=t_step)
    await worker.reset_prefix_cache(timeout=t_step)  # the sleep discarded the cached blocks
    await worker.resume(timeout=t_step)
    got = await worker.weight_version(timeout=t_step)
    if got != progress.serving:
        raise StepFailed(
            progress.reason,
            f"{progress.message}; the pod reports {got!r}, not {progress.serving!r}",
            final=True,
        )


async def mark_ready(
    worker: WorkerClient, version: str, t_step: float, process: str | None = None
) -> None:
    try:
        await worker.mark_ready(version, process=process, timeout=t_step)
    except WorkerError as e:
        if e.code == contract.PROCESS_CHANGED:
            # The container restarted after the probe: the process is not the one probed.
            # Fail closed (it stays unready); the restart is the next pass's to handle.
            raise StepFailed(Reason.ContainerRestarted, e.message, final=True) from e
        # A worker image from before /refit/ready (its readiness probe cannot wait for the
        # vouch either): nothing to do. Any other refusal is the step's failure.
        if (e.kind, e.status) != ("http", 404):
            raise


async def _wait_out_of_endpoints(
    ctx: PassContext, pod: PodView, claimed: ClaimedPod | None = None
) -> None:
    """Before the drain pauses the pod: wait until its Ready condition is no longer True, i.e.
    the kubelet has applied the readiness condition the pass set False, so endpoints stop
    listing the pod. Requests that reach a paused vLLM wait and run after the resume, which
    comes before the probe: sent after the condition went False they would meet the new,
    unprobed weights. A pod without a Ready condition (no kubelet) has nothing to wait for.
    The answer to the pass's last write already shows the condition (``claimed.ready``): the
    pod is read only while that said Ready, i.e. to see the kubelet catch up."""
    if claimed is not None and not claimed.ready:
        return
    limit = float(ctx.spec.sequence.drain_timeout_seconds)
    deadline = times.monotonic() + limit
    while True:
        doc = await ctx.cluster.read_pod(ctx.namespace, pod.name)
        if doc["metadata"].get("uid") != pod.uid:
            raise ClaimLost(f"pod {pod.name} was replaced by another pod of that name")
        conds = {c.get("type"): c for c in (doc.get("status") or {}).get("conditions") or []}
        if conds.get("Ready", {}).get("status") != "True":
            return
        if times.monotonic() >= deadline:
            raise StepFailed(
                Reason.DrainTimeout,
                f"the pod is still Ready {limit:.0f}s after its readiness condition was set "
                "False (is its kubelet reporting?)",
            )
        await asyncio.sleep(DRAIN_POLL_SECONDS / 2)


async def _wait_drain_delay(seq: Sequence, progress: Progress) -> None:
    """Before the drain pauses the pod: until ``drainDelaySeconds`` have passed since the pass
    took it out of traffic (``left_traffic``, from the record: a pass resumed after an
    operator restart, or a retried drain, does not wait again from scratch). Endpoints,
    kube-proxy and gateways learn of the readiness change with some lag, and what they send
    meanwhile the pod still serves, rather than queue it paused until the abort before the
    wake. Nothing is called meanwhile: the pause after it is a worker call like every other,
    so the leader checks its lease and the pod the fencing token first. A plain wait, like a
    retry's backoff: it is bounded by the delay itself (at most DRAIN_DELAY_MAX_SECONDS, even
    when the recording operator's clock ran ahead), drainTimeoutSeconds bounds only the waits
    on the pod, and it counts in the drain step's seconds and the refit's total timeout."""
    delay = seq.drain_delay_seconds
    if not delay or not progress.left_traffic:
        return  # 0 (the default): no wait, not even a yield to the loop
    remaining = min(float(delay), progress.left_traffic + delay - times.now())
    if remaining > 0:
        await asyncio.sleep(remaining)


async def _drain(worker: WorkerClient, seq: Sequence, version: str) -> str:
    """Pause the pod in the refit's drain mode, within ``drainTimeoutSeconds``; the note on
    requests a ``keep`` drain left frozen ("" for none, and for the other modes)."""
    t_step, limit = float(seq.step_timeout_seconds), float(seq.drain_timeout_seconds)
    if seq.drain_mode == "wait":
        # vLLM's /pause?mode=wait answers only once the requests in flight finished: its
        # wait is the drain, so drainTimeoutSeconds bounds it (not the step timeout). A
        # request that outlives it fails the drain closed: the pod stays paused, out of
        # traffic, and the request still finishes on the old weights.
        try:
            await worker.pause("wait", timeout=limit)
        except WorkerError as e:
            if e.kind != "timeout":
                raise
            raise StepFailed(
                Reason.DrainTimeout,
                f"requests still in flight after {limit:.0f}s (pause mode wait)",
            ) from e
    else:
        await worker.pause(seq.drain_mode, timeout=t_step)
    if seq.drain_mode == "keep":
        # Frozen, not drained: they stay in flight through the refit by design and finish on
        # the new weights after the resume (vLLM's weight-version spans name both versions).
        # Waiting for them would only ever end in DrainTimeout.
        kept = await _kept_in_flight(worker, t_step)
        return f"{kept} requests kept in flight, to finish on {version}" if kept else ""
    # Drained: vLLM answers the pause once nothing it runs is in flight (wait: finished;
    # abort: aborted and answered). Not /metrics: requests that reach the pod after the
    # pause began (a gateway that had not yet dropped it) are queued, never run while
    # paused, yet counted as waiting by the last stats the engine published, which a
    # paused engine stops refreshing. Waiting for them held a drain until its timeout
    # (bench under_load: 60.4 s with 3 such requests). The sleep step next aborts them.
    return ""


async def _kept_in_flight(worker: WorkerClient, read_timeout: float) -> int:
    """What a ``keep`` pause froze, by the engine's own count (running + waiting on /metrics),
    read until two reads KEEP_SETTLE_SECONDS apart agree (at most KEEP_SETTLE_READS reads).
    vLLM answers the pause once its engine sent its last step's outputs, but the API server
    records the counts those outputs carry only when its output task processes them, and the
    pause's answer can come first (AsyncLLM.pause_generation sleeps 20 ms for those tasks,
    "not required for correctness"): a single read then gave the step before the last, which
    on a loaded host counted none of the requests frozen there (CI: the note was empty beside
    a request with A's tokens and B's). A keep-paused engine runs no more steps, so the
    counts settle once the last one is recorded."""
    kept = await worker.requests_in_flight(timeout=read_timeout)
    for _ in range(KEEP_SETTLE_READS - 1):
        await asyncio.sleep(KEEP_SETTLE_SECONDS)
        again = await worker.requests_in_flight(timeout=read_timeout)
        if again == kept:
            break
        kept = again
    return kept


async def _judge_drafter(
    worker: WorkerClient,
    outcome: probe.ProbeOutcome,
    prompts: list[list[int]],
    thresholds: Thresholds,
    seconds: float,
    *,
    batch: bool,
) -> probe.ProbeOutcome:
    """The drafter's share of accepted drafts while the target decodes the probe prompts
    greedily (probe.judge_drafter): the pod is out of traffic, so the counters are ours."""
    if thresholds.min_draft_acceptance <= 0:
        return outcome
    try:
        drafted, accepted = await worker.draft_acceptance(prompts, timeout=seconds, batch=batch)
    except WorkerError as e:  # /metrics and completions: reads, never fenced
        return probe.inconclusive(Reason.DraftNoData, f"draft acceptance: {e.message}")
    return probe.judge_drafter(outcome, drafted, accepted, thresholds.min_draft_acceptance)


async def _probe(
    ctx: PassContext, pod: PodView, worker: WorkerClient, progress: Progress
) -> Progress:
    seq, thresholds = ctx.spec.sequence, ctx.spec.probe.thresholds
    began = times.monotonic()
    timeout = float(seq.probe_timeout_seconds)
    outcome: probe.ProbeOutcome | None = None
    try:
        # The process probed: the vouch after a passed probe is bound to it, so a container
        # that restarts in between is never vouched for on weights nobody probed.
        worker.probed_process = await worker.process_identity(timeout=timeout)
        reference = await ctx.reference(progress.path, worker)
        # One request for every prompt: the probe's cost is then one forward pass's overhead
        # (one per prompt where the pod runs LoRA: Progress.lora).
        prompts = [list(p.token_ids) for p in reference.prompts]
        scored = await worker.score_prompts(prompts, timeout=timeout, model=progress.probe_model,
                                            batch=not progress.lora)  # fmt: skip
    except probe.ReferenceMismatch as e:
        # Rewritten since the preflight admitted it (read again after an operator restart):
        # the weights cannot be judged, so the pod stays out of traffic and the gate decides.
        outcome = probe.inconclusive(e.reason, str(e))
    except WorkerError as e:
        if e.code == contract.STALE_FENCE:
            raise ClaimLost(f"pod {pod.name}: probe: {e.message}") from e
        if e.kind == "http" and e.status is not None and 400 <= e.status < 500:
            outcome = probe.inconclusive(Reason.ReferenceUnscorable, e.message)
        elif e.kind == "protocol":
            outcome = probe.ProbeOutcome("Fail", Reason.ProbeGarbage, e.message)
        elif progress.attempts < seq.retries:
            reason = Reason.ProbeTimeout if e.kind == "timeout" else Reason.ProbeNoData
            metrics.step_finished(
                ctx.namespace, ctx.fleet, progress.step, "failure", times.monotonic() - began
            )
            return podflow.step_failed(
                progress, progress.step, reason, e.message, times.now(), retries=seq.retries
            )
        else:
            reason = Reason.ProbeTimeout if e.kind == "timeout" else Reason.ProbeNoData
            outcome = probe.inconclusive(reason, e.message)
    if outcome is None:
        outcome = probe.evaluate(reference, scored, thresholds, ctx.peer_nlls(progress.version))
        if progress.drafter and outcome.verdict == "Pass":
            outcome = await _judge_drafter(worker, outcome, prompts, thresholds, timeout,
                                           batch=not progress.lora)  # fmt: skip
    seconds = times.monotonic() - began
    metrics.step_finished(
        ctx.namespace,
        ctx.fleet,
        progress.step,
        "success" if outcome.verdict == "Pass" else "failure",
        seconds,
    )
    metrics.probe_result(
        ctx.namespace, ctx.fleet, ctx.refit_name, pod.name, outcome.verdict,
        outcome.nll, outcome.reference_nll, outcome.mean_abs_diff, outcome.max_abs_diff,
    )  # fmt: skip
    progress = replace(progress, process=worker.probed_process or "")
    progress = podflow.probe_judged(progress, outcome, times.now())
    if outcome.verdict == "Pass":
        return podflow.step_done(progress, progress.step, seconds, times.now())
    return progress


# The code of the steps every weights pass runs (a checkpoint's and a broadcast's: their modules
# in sources/ add how the weights arrive); an adapter pass shares some of them.
WEIGHTS_STEP_CODE: dict[Step, StepCode] = {
    Step.drain: _drain_weights,
    Step.sleep: _sleep,
    Step.wakeWeights: _wake_weights,
    Step.wakeKV: _wake_kv,
    Step.resetCache: reset_cache_step,
    Step.stampVersion: _stamp_version,
    Step.checksum: _checksum,
    Step.probe: probe_step,
    Step.ready: ready_step,
    Step.restore: _restore_step,
}
