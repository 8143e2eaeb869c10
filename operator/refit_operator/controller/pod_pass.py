"""Runs one pod's refit pass: takes the pod's claim, executes the step podflow names
(steps.STEP_CODE), records the progress on the pod where podflow says a write has a reason
(``must_record``), repeats until the pass ends: two pod writes per pass in the common case,
three for an adapter (docs/operator.md, "API writes per pod and pass"). I/O only; what to do
next, and what to record when, is always podflow's decision.

The live progress of every pass is also kept in memory (``PassContext.live``): the reconcile
loop folds it into the WeightRefit status once per tick, so users see each pod's current step
without a write per step."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from refit_worker import contract

from ..core import groups, podflow, times
from ..core.admission import admission_problem, joins_layout, reach_problem
from ..core.claim import Claim, claim_fence
from ..core.decision import PodStart
from ..core.gate import adapter_missing, pass_readiness
from ..core.podflow import Finished, Progress, RunStep, WaitUntil
from ..core.podview import PodView
from ..core.preflight_cache import Identity
from ..core.reasons import Problem, Reason, pass_event, step_timeout
from ..core.sequences import Step
from ..edges import metrics
from ..edges.cluster import ClaimedPod, ClaimLost
from ..edges.worker_client import WorkerClient, WorkerError
from .pass_context import PassContext, StepFailed, StepRun
from .sources import SOURCES, run_step_code, source_for


def worker_error_reason(e: WorkerError, step: str) -> tuple[str, bool]:
    """(reason, final) for a transport or worker error in ``step``."""
    if e.kind == "rejected" and e.code:
        return e.code, e.code != Reason.LoadFailed
    return {
        "timeout": (step_timeout(step), False),
        "connect": (Reason.PodUnreachable, False),
        "protocol": (Reason.WorkerProtocolError, False),
        "http": (Reason.WorkerHttpError, False),
        "rejected": (Reason.WorkerRejected, False),
    }[e.kind]


async def run_pass(ctx: PassContext, pod: PodView, start: PodStart) -> Progress:
    """Run one pass on ``pod`` under a claim of its own. Raises PodBusy when the pod changed
    since it was listed (the pass never started) and ClaimLost when another pass took the
    pod over (this one stops without another call or write)."""
    try:
        return await _run_pass(ctx, pod, start)
    finally:
        if ctx.broadcast is not None:  # its round no longer waits for this pod
            ctx.broadcast.rounds.leave(pod.name)


def _now(ctx: PassContext, pod: str, progress: Progress) -> None:
    """What the pass did so far, for the reconcile (``live``) and the pods' peers."""
    ctx.live[pod] = progress
    ctx.readbacks.put(pod, progress)


async def _run_pass(ctx: PassContext, pod: PodView, start: PodStart) -> Progress:
    # The claim's write is conditional on the pod's resourceVersion as listed: the token.
    fence = claim_fence(pod.resource_version) or ctx.next_fence()
    claim = Claim(ctx.refit_name, ctx.refit_uid, fence, ctx.cluster.identity, ctx.lease,
                  ctx.lease_seconds)  # fmt: skip
    worker = ctx.client(pod, claim.fence)
    resumed = bool(start.resume and pod.progress)
    progress = pod.progress if resumed else None
    if progress is None:
        # A pod whose weights are another fleet's (moved here by its labels) does not keep
        # serving them: it leaves traffic in the pass's first write, and has none to go back to.
        serving = pod.serving if start.keep_serving else ""
        if serving and adapter_missing(pod, pod.progress):
            # Lost to a restart or a reload of the base: the process serves nothing of it
            # (the pass is here to load it again), so a refusal has nothing to put back.
            serving = ""
        progress = podflow.start(
            ctx.refit_name, ctx.refit_uid, start.version, start.path, times.now(),
            created=ctx.refit_created, rollback=start.rollback, restarts=pod.restarts,
            incarnation=pod.incarnation,
            serving=serving, serving_path=pod.serving_path,
            source=source_for(ctx.spec).pass_kind(start), adapter=ctx.spec.track,
        )  # fmt: skip
        # Asked before the claim is taken, so without the pass's fencing token: a token the
        # pod has seen must belong to the pass that holds it.
        # A pass that receives cannot run without the broadcast's source; a rollback loads
        # the previous checkpoint (start.path) and needs none.
        unsourced = ctx.source_problem if not start.path else None
        refused = unsourced or await _admission(ctx, pod, ctx.client(pod, None))
        progress = SOURCES[progress.source].begin(ctx, pod, progress)  # after the admission
        if refused is not None:
            # A pod that joined after the fleet preflight gets the same checks; refused,
            # it is left exactly as it was and the refusal is recorded.
            progress = podflow.step_failed(
                progress,
                progress.step,
                refused.reason,
                refused.message,
                times.now(),
                retries=0,
                final=True,
            )
            handle = await ctx.cluster.claim(ctx.namespace, pod, claim, progress, None)
            _now(ctx, pod.name, progress)
            await _finish(ctx, handle, pod, progress)
            return progress
        # A pod that serves a probed version keeps serving while the checkpoint stages; any
        # other pod leaves traffic in the same write that claims it and records the new pass.
        # A checkpoint is staged before the claim where it can be: then that one write also
        # takes the pod out of traffic, and the pass writes the pod twice, not three times.
        _now(ctx, pod.name, progress)
        progress = await _stage_unclaimed(ctx, pod, progress)
        handle = await ctx.cluster.claim(
            ctx.namespace, pod, claim, progress, pass_readiness(pod, progress)
        )
    else:
        # Resumed after an operator restart (or a takeover from a frozen leader): the claim
        # moves to this pass, whose newer fencing token the pod then requires; the record it
        # writes says whether the last driver may have been inside the load.
        progress = podflow.resumed(progress)
        handle = await ctx.cluster.claim(ctx.namespace, pod, claim, progress, None)
    _now(ctx, pod.name, progress)
    while True:
        action = podflow.next_action(progress, times.now())
        if isinstance(action, Finished):
            return progress
        if isinstance(action, WaitUntil):
            await asyncio.sleep(max(0.0, action.at - times.now()))
            continue
        assert isinstance(action, RunStep)
        before = progress
        progress = await _run_step(ctx, pod, worker, progress, action.step, resumed, handle)
        _now(ctx, pod.name, progress)
        if progress.finished_pass:
            await _finish(ctx, handle, pod, progress)
        elif podflow.must_record(before, progress):
            # A failed try, or the stage done: this record takes the pod out of traffic,
            # before the drain pauses it.
            leaves = before.in_traffic and not progress.in_traffic
            await handle.record(progress, pass_readiness(pod, progress) if leaves else None)


async def _stage_unclaimed(ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
    """Stage the checkpoint of a pass that would stage while the pod serves, before the pass
    claims the pod: without a fencing token, as the stage of the next batch ahead of its turn
    is (reconcile_loop._stage_ahead): staging changes nothing a pass relies on (the load uses
    staged bytes only if no file changed since), and no fenced call comes before the claim.
    Staged, the pass is past its last step in traffic, so the claim's write is the one that
    takes the pod out (before the drain pauses it). A try that fails changes nothing: the
    claimed pass stages as before, with its retries, records and Events."""
    flow = SOURCES[progress.source].flow
    if not (flow.stages_ahead and progress.in_traffic and progress.step == flow.last_serving_step):
        return progress
    step = Step(progress.step)
    began = times.monotonic()
    run = StepRun(ctx.client(pod, None), ctx.spec.sequence, progress, False, ctx, pod)
    try:
        note = await run_step_code(run, step)
    except (WorkerError, StepFailed):
        return progress
    assert isinstance(note, str), f"step {step!r} judges nothing"
    seconds = times.monotonic() - began
    metrics.step_finished(ctx.namespace, ctx.fleet, step, "success", seconds)
    staged = replace(run.progress, staging=note) if note else run.progress
    return podflow.step_done(staged, step, seconds, times.now())


async def _admission(ctx: PassContext, pod: PodView, worker: WorkerClient) -> Problem | None:
    if pod.group_problem is not None:  # a pod group without its leader, or a pod of none
        return pod.group_problem
    if not pod.has_gate:
        return Problem(Reason.MissingReadinessGate, "the pod does not declare the readiness gate")
    if ctx.admitted.get(pod.name) == Identity.of(pod):
        return None  # checked by the fleet preflight, and the same process answers
    t_step = float(ctx.spec.sequence.step_timeout_seconds)
    # The same process's answers, kept by an earlier preflight or admission, are not asked
    # again (core/preflight_cache.py); they are judged as fresh ones.
    kept = ctx.answers.get(pod)
    if kept is not None:
        info = kept.info
    else:
        try:
            info = await worker.refit_info(timeout=t_step)
        except WorkerError:
            return None  # transient or not: the first step meets it again, with retries
        ctx.answers.saw_info(pod, info)
    spec = ctx.spec
    source = source_for(spec)
    problem = admission_problem(info, spec.allow_unsafe_backends, spec.sequence.sleep_level,
                                adapter=not source.flow.reloads)  # fmt: skip
    if problem is None:
        problem = joins_layout(ctx.layout, info)
    if info.max_lora_rank > 0:
        ctx.lora.add(pod.name)
    if info.drafter:
        ctx.drafters[pod.name] = info.drafter
    if problem is not None:
        return problem
    size: int | str
    if kept is not None and kept.world_size is not None:
        size = kept.world_size
    else:
        try:
            size = await worker.world_size(timeout=t_step)
            ctx.answers.saw_world_size(pod, size)
        except WorkerError as e:  # it answered refit_info: no pass without the count
            size = f"get_world_size failed ({e.kind}): {e.message}"
    return reach_problem(info, size) or await source.admit(ctx, pod, worker, t_step)


async def _run_step(
    ctx: PassContext,
    pod: PodView,
    worker: WorkerClient,
    progress: Progress,
    step: Step,
    resumed: bool,
    claimed: ClaimedPod,
) -> Progress:
    retries = ctx.spec.sequence.retries
    began = times.monotonic()
    run = StepRun(worker, ctx.spec.sequence, progress, resumed, ctx, pod, claimed)
    try:
        done = await run_step_code(run, step)
    except WorkerError as e:
        if e.code == contract.STALE_FENCE:  # a newer pass owns the pod: stop, touch nothing
            raise ClaimLost(f"pod {pod.name}: {step}: {e.message}") from e
        reason, final = worker_error_reason(e, step)
        # A broadcast round cannot be repeated by one pod alone: its pass ends here.
        final = final or step == Step.receive
        result = "timeout" if e.kind == "timeout" else "failure"
        metrics.step_finished(ctx.namespace, ctx.fleet, step, result, times.monotonic() - began)
        await _event(ctx, Reason.PodStepRetry if not final else Reason.PodStepFailed,
                     f"pod {pod.name}: {step}: {reason}: {e.message}", "Warning")  # fmt: skip
        return podflow.step_failed(
            run.progress, step, reason, e.message, times.now(), retries=retries, final=final
        )
    except StepFailed as e:
        metrics.step_finished(ctx.namespace, ctx.fleet, step, "failure", times.monotonic() - began)
        await _event(
            ctx, Reason.PodStepFailed if e.final else Reason.PodStepRetry,
            f"pod {pod.name}: {step}: {e.reason}: {e.message}", "Warning",
        )  # fmt: skip
        return podflow.step_failed(
            run.progress, step, e.reason, e.message, times.now(), retries=retries, final=e.final
        )
    if isinstance(done, Progress):  # judged by the step itself (its metrics too)
        return done
    seconds = times.monotonic() - began
    metrics.step_finished(ctx.namespace, ctx.fleet, step, "success", seconds)
    progress = run.progress
    if step == Step.restore:
        return podflow.restored(progress, times.now())
    if done:  # how the stage held the checkpoint, or what the drain left in flight
        if step == Step.drain:
            progress = replace(progress, drained=done)
        else:
            progress = replace(progress, staging=done)
    return podflow.step_done(progress, step, seconds, times.now())


async def _finish(ctx: PassContext, pod: ClaimedPod, unit: PodView, progress: Progress) -> None:
    """The pass's last record: progress and readiness condition in one write (the gate over
    everything the unit serves with this record: True only when every track serves probed
    weights; otherwise the pod stays out of traffic and the condition says which track holds
    it) that also releases the claim; then, for a pass that did not succeed, the pod's Event.
    A pod that succeeded gets none: its condition and record say so, and the refit's own
    Succeeded Event counts them (10,000 such Events would bury the ones that need a look)."""
    unit = await _run_now(ctx, unit)
    await pod.record(progress, pass_readiness(unit, progress), release=True)
    seconds = podflow.out_of_traffic_seconds(progress)
    if seconds is not None:  # back in traffic
        metrics.pod_out_of_traffic(ctx.namespace, ctx.fleet, seconds)
    if progress.outcome == "Succeeded":
        return
    msg = f"{progress.reason}: {progress.message}"
    await _event(ctx, pass_event(progress.outcome), f"pod {pod.name}: {msg}", "Warning")


async def _run_now(ctx: PassContext, unit: PodView) -> PodView:
    """The unit with its pods as they run now (the pod watch's copies, no request), for the
    pass's last write: a container that restarted while the pass ran lost what the records
    say it holds (a pass that went on calling the new process may even have vouched for its
    boot weights), and a follower's restart reaches no vouch of the leader's process; the
    gate then keeps the unit out until a pass of this run brings it back. Also a follower
    replaced or deleted meanwhile."""
    pods = await ctx.cluster.pods_named(ctx.namespace, (unit.name, *unit.members))
    now = groups.units(pods, ctx.spec.fleet.groups)
    fresh = next((u for u in now if u.name == unit.name), None)
    if fresh is None:  # the pod is gone: its write fails, not this check
        return unit
    return replace(
        unit, running=fresh.running, deleting=fresh.deleting, restarts=fresh.restarts,
        incarnation=fresh.incarnation, group_problem=fresh.group_problem,
    )  # fmt: skip


async def _event(ctx: PassContext, reason: str, message: str, etype: str = "Normal") -> None:
    await ctx.cluster.event(ctx.namespace, ctx.refit_doc, reason, message, etype)
