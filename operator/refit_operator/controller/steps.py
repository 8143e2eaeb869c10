"""The code of each step of a pod's pass, one table from ``podflow.Step`` to the coroutine that
runs it (``STEP_CODE``; ``ADAPTER_STEP_CODE`` where an adapter pass differs): the stage, the
drain in its mode, sleep and wakes, the load or the broadcast's receive, the cache reset, the
version stamp, the read-back, the probe, the vouch, the restore. Each step is one try: its
retries, records and events are the pass's (pod_pass.py). The bench and the tests run a step
alone through ``execute_step``."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from refit_worker import contract

from ..core import checksums, podflow, probe, times
from ..core.api import Broadcast, Sequence, Thresholds
from ..core.gate import gate, served
from ..core.podflow import Progress, Step
from ..core.podview import PodView
from ..core.reasons import Reason
from ..edges import metrics
from ..edges.cluster import ClaimLost
from ..edges.worker_client import WorkerClient, WorkerError
from .pass_context import PassContext, StepCode, StepFailed, StepRun
from .rounds import TrainerTimeout, rank_problem

DRAIN_POLL_SECONDS = 0.5
# A keep drain's count of what it froze: reads of /metrics this far apart, until two agree.
KEEP_SETTLE_SECONDS = 0.2
KEEP_SETTLE_READS = 5


async def run_step_code(run: StepRun, step: Step) -> str | Progress:
    """Run ``step``'s code (STEP_CODE; an adapter pass's own from ADAPTER_STEP_CODE), or
    nothing where the step does not apply at this sleep level and weight source."""
    source = run.progress.source
    if step != Step.restore and not podflow.step_applies(step, run.seq.sleep_level, source):
        return ""
    own = ADAPTER_STEP_CODE.get(step) if source == "adapter" else None
    return await (own or STEP_CODE[step])(run)


async def execute_step(
    worker: WorkerClient, seq: Sequence, progress: Progress, step: str, resumed: bool
) -> str:
    """Run one step of the pod sequence outside a pass (the bench's refit cycle, the tests):
    the same code the pass runs, without the pass's peers, rounds or probe reference. Returns
    the stage step's note (how the worker staged the checkpoint) or the drain's (requests a
    ``keep`` drain froze), "" otherwise."""
    done = await run_step_code(StepRun(worker, seq, progress, resumed), Step(step))
    assert isinstance(done, str), f"step {step!r} judges only within a pass"
    return done


async def _stage(run: StepRun) -> str:
    staged = await run.worker.stage(run.progress.path, timeout=run.t_load)
    return str(staged.get("note", ""))[:200]


async def _drain_step(run: StepRun) -> str:
    if run.ctx is not None and run.pod is not None:
        await _wait_out_of_endpoints(run.ctx, run.pod)
    await _wait_drain_delay(run.seq, run.progress)
    # The record before it set the readiness condition False.
    return await _drain(run.worker, run.seq, run.progress.version)


async def _drain_weights(run: StepRun) -> str:
    """A weights pass's drain, which also unloads every LoRA adapter the pod serves: an
    adapter was probed on the base it serves now, and vLLM keeps adapters across a reload.
    Their records stay: the gate reads them against the base this pass leaves (core/gate.py:
    on another version the adapter's track needs a refit; on the same, its target loads it
    again)."""
    note = await _drain_step(run)
    if run.progress.lora:
        for name in await run.worker.adapters(timeout=run.t_step):
            await run.worker.unload_adapter(name, timeout=run.t_step)
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


async def _load(run: StepRun) -> str:
    progress = run.progress
    # Never reload blindly: a load that finished before a restart stamped the version.
    if podflow.must_read_back(progress, run.resumed):
        info = await run.worker.refit_info(timeout=run.t_step)
        if not podflow.load_needed(info.weight_version, progress.version):
            return ""
    await run.worker.load(progress.path, progress.version, timeout=run.t_load)
    return ""


async def _receive_step(run: StepRun) -> str:
    ctx, pod = run.in_pass(Step.receive)
    try:
        await _receive(ctx, pod, run.worker, run.progress, run.resumed)
    finally:
        if ctx.broadcast is not None:
            ctx.broadcast.rounds.leave(pod.name)
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


async def _reset_cache(run: StepRun) -> str:
    # A keep drain's frozen requests hold KV blocks computed on the old weights: vLLM refuses
    # the reset while they do, so they are preempted and recompute on the new.
    keep = run.seq.drain_mode == "keep"
    await run.worker.reset_prefix_cache(reset_running=keep, timeout=run.t_step)
    if not podflow.step_applies(Step.wakeKV, run.seq.sleep_level, run.progress.source):
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


async def _probe_step(run: StepRun) -> Progress:
    ctx, pod = run.in_pass(Step(run.progress.step))
    return await _probe(ctx, pod, run.worker, run.progress)


async def _probe_staged(run: StepRun) -> Progress:
    """The staged adapter's probe; once it passed, the staged name is unloaded at once: the
    swap loads the same files (checked again) under the served name, so nothing staged
    outlives this step, whatever fails after it (a drain, the swap, the served probe). A
    verdict that failed goes to the restore, which unloads it too."""
    judged = await _probe_step(run)
    if judged.step == Step.drain:
        await _unload_staged(run)
    return judged


async def _ready(run: StepRun) -> str:
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
    if run.pod is None:  # a step run alone (the bench): no pod to judge, as before
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


# An adapter pass's own steps (the probes score through ``progress.probe_model``). Each is
# idempotent: a retried or resumed load first unloads the staged name it may already have
# loaded.
async def _check_adapter(run: StepRun) -> str:
    checked = await run.worker.adapter_check(run.progress.path, timeout=run.t_load)
    return f"adapter rank {checked.get('rank')}, {checked.get('bytes')} bytes verified"


async def _load_adapter(run: StepRun) -> str:
    p = run.progress
    staged = podflow.staged_adapter_name(p.adapter, p.version)
    await run.worker.unload_adapter(staged, timeout=run.t_step)
    await run.worker.load_adapter(staged, p.path, timeout=run.t_load)
    return ""


async def _swap_adapter(run: StepRun) -> str:
    # The files the staged probe judged, unchanged since (digests again; an adapter is small):
    # then in place under the served name, new weights loaded before the old go.
    p = run.progress
    await run.worker.adapter_check(p.path, timeout=run.t_load)
    await run.worker.load_adapter(p.adapter, p.path, inplace=True, timeout=run.t_load)
    return ""


async def _unload_staged(run: StepRun) -> str:
    p = run.progress
    await run.worker.unload_adapter(
        podflow.staged_adapter_name(p.adapter, p.version), timeout=run.t_step
    )
    return ""


async def _restore_adapter_step(run: StepRun) -> str:
    await restore_adapter(run.worker, run.seq, run.progress)
    return ""


# Every step and the code that runs it (podflow.STEPS and ADAPTER_STEPS give their order).
STEP_CODE: dict[Step, StepCode] = {
    Step.stage: _stage,
    Step.drain: _drain_weights,
    Step.sleep: _sleep,
    Step.wakeWeights: _wake_weights,
    Step.load: _load,
    Step.receive: _receive_step,
    Step.wakeKV: _wake_kv,
    Step.resetCache: _reset_cache,
    Step.stampVersion: _stamp_version,
    Step.checksum: _checksum,
    Step.probe: _probe_step,
    Step.ready: _ready,
    Step.restore: _restore_step,
    # An adapter pass's own steps (drain, resetCache and probe are the weights pass's).
    Step.loadAdapter: _load_adapter,
    Step.probeStaged: _probe_staged,
    Step.swap: _swap_adapter,
}
# Where an adapter pass runs a step of the same name differently.
ADAPTER_STEP_CODE: dict[Step, StepCode] = {
    Step.stage: _check_adapter,  # verify the adapter's files: nothing to stage
    Step.drain: _drain_step,  # as for weights, without unloading adapters (it swaps one)
    Step.restore: _restore_adapter_step,  # unload the staged name
}


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


async def read_back(worker: WorkerClient, t_step: float) -> checksums.Readback:
    """What the pod's model holds now: vLLM's per-parameter digests (/weight_checker, through
    the guard with the pass's fencing token) and the extension's per-buffer digests."""
    parameters = await worker.weight_checksums(timeout=t_step)
    dtype, buffers = await worker.buffer_digests(timeout=t_step)
    if not parameters:
        raise StepFailed(Reason.WorkerProtocolError, "the weight checker read back no parameter")
    return checksums.read_back(dtype, parameters, buffers)


async def _receive(
    ctx: PassContext, pod: PodView, worker: WorkerClient, progress: Progress, resumed: bool
) -> None:
    """The broadcast's receive: join the pod's round, and once the trainer announced it,
    join its transfer at the rank assigned, receive, check and load, finish, read back."""
    b = ctx.spec.broadcast
    assert b is not None, "a broadcast pass needs spec.broadcast"
    t_step = float(ctx.spec.sequence.step_timeout_seconds)
    digest = b.manifest.digest
    if podflow.must_read_back(progress, resumed):
        try:  # a receive that finished before a restart is not received again
            await worker.received(digest, progress.version, timeout=t_step)
            return
        except WorkerError as e:
            if e.code == contract.STALE_FENCE:
                raise
            # Not loaded here: receive it again, in a new round.
    if ctx.broadcast is None:  # its manifest is gone: nothing to check a new send against
        assert ctx.source_problem is not None
        raise StepFailed(ctx.source_problem.reason, ctx.source_problem.message, final=True)
    workers = await worker.world_size(timeout=t_step)  # the ranks this pod takes
    try:
        rank, world = await ctx.broadcast.rounds.join(pod.name, float(b.timeout_seconds), workers)
    except TrainerTimeout as e:
        raise StepFailed(Reason.TrainerTimeout, str(e), final=True) from e
    received = await receive_broadcast(
        worker, b, ctx.broadcast.manifest, rank, world, progress.version, t_step
    )
    problem = rank_problem(received, rank, world)
    if problem is not None:
        raise StepFailed(problem.reason, problem.message)


async def receive_broadcast(
    worker: WorkerClient,
    spec: Broadcast,
    manifest: dict[str, object],
    rank: int,
    world: int,
    version: str,
    t_step: float,
) -> dict[str, object]:
    """One pod's side of a round, once the trainer announced it (the bench runs the same
    code): join the transfer at ``rank`` of ``world``, receive, check and load, finish, and
    read back what was loaded (refit_received); returns that record."""
    # The pod's own transfer timeout answers first; the HTTP timeout only catches a hung pod.
    t_transfer = float(spec.timeout_seconds) + t_step
    init = {
        "master_address": spec.rendezvous.host,
        "master_port": spec.rendezvous.port,
        "rank_offset": rank,
        "world_size": world,
        "timeout_seconds": spec.timeout_seconds,
    }
    await worker.init_weight_transfer(init, timeout=t_transfer)
    await worker.start_weight_update(timeout=t_step)
    await worker.update_weights({"manifest": manifest}, timeout=t_transfer)
    await worker.finish_weight_update(version, timeout=t_step)
    # Records the version as the worker's and refuses unless it loaded exactly the promise.
    return await worker.received(spec.manifest.digest, version, timeout=t_step)


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


async def _wait_out_of_endpoints(ctx: PassContext, pod: PodView) -> None:
    """Before the drain pauses the pod: wait until its Ready condition is no longer True, i.e.
    the kubelet has applied the readiness condition the pass set False, so endpoints stop
    listing the pod. Requests that reach a paused vLLM wait and run after the resume, which
    comes before the probe: sent after the condition went False they would meet the new,
    unprobed weights. A pod without a Ready condition (no kubelet) has nothing to wait for."""
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
