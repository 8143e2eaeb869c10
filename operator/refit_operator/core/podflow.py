"""The per-pod refit sequence as plain data: where a pod stands and what to do next.

A pod's progress is stored on the pod itself (annotation ``refit.rollout.dev/progress``, JSON),
so an operator that restarts resumes at the first step not recorded as done. It is recorded
only where a write has a reason (``must_record``): when the pass starts (the claim), when it
takes a pod that served through the staging out of traffic (before the drain pauses it), on
every failed try, and when the pass ends: two pod writes per pass in the common case (the
claim takes the pod out of traffic: a checkpoint stages before it), three where the pod serves
while the pass stages under its claim (an adapter's staged load and probe) (docs/operator.md,
"API writes per pod and pass"). A restart therefore repeats at most the steps since the last
record, which is safe because every step is idempotent; the one that is not safe to repeat
blindly, the load, is preceded by a read-back of the pod's weight version whenever it may
already have run (``must_read_back``, ``load_needed``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from refit_worker.contract import API_GROUP

from . import times
from .api import PodProbe
from .probe import ProbeOutcome
from .reasons import Reason
from .sequences import (
    FINAL_CODES,
    FLOWS,
    LOAD_STEPS,
    RESTORE,
    STEPS,
    UNTOUCHED_LOAD_CODES,
    Source,
    Step,
    first_step,
    last_step_in_traffic,
    steps_of,
)

# Where a pod's record lives on the pod (docs/operator.md).
PROGRESS_ANNOTATION = f"{API_GROUP}/progress"
# A LoRA adapter's record (spec.adapter), one per adapter name beside the base weights' own:
# an adapter pass never overwrites the record that the base weights' rollback and
# convergence read. The pod's claim stays one: one pass at a time, whatever it refits.
ADAPTER_PROGRESS_PREFIX = f"{API_GROUP}/adapter-progress."


def progress_annotation(track: str) -> str:
    """The annotation holding a pod's record of ``track`` (WeightRefitSpec.track: "" for the
    base weights, else the adapter's name)."""
    return f"{ADAPTER_PROGRESS_PREFIX}{track}" if track else PROGRESS_ANNOTATION


BACKOFF_BASE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0

Outcome = Literal["", "Succeeded", "Failed", "Inconclusive"]


@dataclass(frozen=True)
class Progress:
    """One pod's walk through STEPS for one refit pass (a rollback is a second pass)."""

    refit: str  # WeightRefit name
    uid: str  # WeightRefit uid: progress of a deleted-and-recreated refit is not ours
    version: str  # the version this pass brings the pod to
    path: str
    rollback: bool = False
    source: Source = "checkpoint"  # where the weights come from: ``path``, or the trainer
    created: str = ""  # the WeightRefit's creation order (times.creation_order): which is newer
    restarts: int = 0  # the pod's container restarts when the pass began: a restart since
    # then means the container lost the weights this pass loaded
    # A pod group's followers when the pass began (PodView.incarnation): one replaced since is
    # the group's restart. "" for a pod alone.
    incarnation: str = ""
    # The first step not yet done ("" once the pass is over): a Step's value (read back from
    # the annotation as the plain string, which compares equal to its Step).
    step: str = STEPS[0]
    attempts: int = 0  # failed tries of `step`
    not_before: float = 0.0  # epoch seconds: backoff before the next try
    outcome: Outcome = ""
    reason: str = ""
    message: str = ""
    started: float = 0.0
    finished: float = 0.0
    step_seconds: dict[str, float] = field(default_factory=dict)
    probe: PodProbe | None = None  # the verdict and numbers, as status.pods[].probe shows them
    # The version the pod served, with a passed probe, when the pass began ("" if none): such
    # a pod keeps serving while the checkpoint stages, and goes back to serving it when the
    # load is refused before the model was touched.
    serving: str = ""
    # The checkpoint ``serving`` was loaded from ("" for none, or a broadcast's): what a
    # rollback of this pass loads into this pod (docs/concepts.md, "Rollback").
    serving_path: str = ""
    left_traffic: float = 0.0  # epoch seconds this pass took the pod out of traffic (0: never)
    # Epoch seconds the drain step ended (0: not yet): the requests in flight then had been
    # waited for, aborted or frozen, as the drain mode says (the traffic tests judge by it).
    drained_at: float = 0.0
    restored: bool = False  # the pass failed and the pod serves ``serving`` again
    staging: str = ""  # how the worker staged the checkpoint (memory, or why not)
    # Requests a ``keep`` drain froze in flight ("" for none): they finish on ``version``
    # after the resume, with tokens from both versions (said on the readiness condition).
    drained: str = ""
    # A try of this pass's load (or receive) may have changed the model: it failed after the
    # worker may have begun (LoadFailed, a timeout, a lost connection), or it may have run
    # under an operator that stopped. From then on only a probe can say what the pod serves,
    # so the pass never restores it to ``serving``. Recorded, so it survives a restart.
    touched: bool = False
    # The identity of the pod process whose weights the probe scored (GET /refit/ready; ""
    # before the probe, or from a worker image without one): the vouch names it, so a
    # container that restarted since, or an operator that resumes the pass, never vouches
    # for weights nobody probed.
    process: str = ""
    # An adapter pass (source "adapter"): the name clients send for the adapter (spec.adapter
    # .name); the new version is staged under staged_adapter_name(adapter, version).
    adapter: str = ""
    # The pod's speculative drafter with weights of its own (refit_info.drafter, e.g.
    # "draft_model"), refitted with its target: the probe also judges its greedy acceptance
    # (probe.judge_drafter). Recorded, so a pass resumed after a restart judges it too.
    drafter: str = ""
    # The pod's vLLM runs LoRA (refit_info.max_lora_rank > 0): its probe scores one prompt per
    # request, as a batch of prompt-logprob sequences kills vLLM 0.32's LoRA-enabled CPU
    # engine. Recorded, so a pass resumed after a restart (no preflight) does not batch.
    lora: bool = False
    # An adapter pass: the base weights it was probed on, as the pod's base record named them
    # when the pass began (``base_pass``: that record's pass, base_key). The gate serves an
    # adapter only on exactly that base: a base pass that left traffic since unloaded it.
    base_version: str = ""
    base_pass: str = ""

    @property
    def track(self) -> str:
        """The weights this pass refits (WeightRefitSpec.track): where its record lives."""
        return self.adapter

    @property
    def probe_model(self) -> str | None:
        """The model name the pending probe scores through (None: the served base model)."""
        if not self.adapter:
            return None
        if self.step == Step.probeStaged:
            return staged_adapter_name(self.adapter, self.version)
        return self.adapter

    # The read-back after the load (checksums.py): the layout of the pod's tensors and one
    # digest over them ("" before the checksum step).
    layout: str = ""
    checksum: str = ""

    @property
    def finished_pass(self) -> bool:
        return self.outcome != ""

    @property
    def in_traffic(self) -> bool:
        """The pod serves its earlier weights (or adapter): staging, refused while staging, or
        restored."""
        if self.restored:
            return True
        flow = FLOWS[self.source]
        if flow.serves_beside:
            # Before the swap the base weights (and the old adapter, if any) serve on: an
            # adapter's restore only unloads the staged name.
            steps = {*flow.serving_steps, RESTORE}
            return self.step in steps and not self.left_traffic
        return bool(self.serving) and self.step in flow.serving_steps and not self.left_traffic

    def to_annotation(self) -> str:
        # The probe in the camelCase shape of status.pods[].probe, as records have always held it.
        probe = None if self.probe is None else self.probe.dump()
        doc = {**asdict(replace(self, probe=None)), "probe": probe}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str | None) -> Progress | None:
        """Parse the annotation; anything unreadable is treated as no progress at all."""
        if not text:
            return None
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                return None
            probe = doc.pop("probe", None)
            return cls(**doc, probe=None if probe is None else PodProbe.model_validate(probe))
        except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
            return None

    def newer_than(self, created: str, refit: str) -> bool:
        """Whether this pass belongs to a refit created after (created, refit), in the one
        creation order (times.order_key) the queue uses too."""
        return times.order_key(self.created, self.refit) > times.order_key(created, refit)


def start(
    refit: str,
    uid: str,
    version: str,
    path: str,
    now: float,
    *,
    created: str = "",
    rollback: bool = False,
    restarts: int = 0,
    incarnation: str = "",
    serving: str = "",
    serving_path: str = "",
    source: Source = "checkpoint",
    adapter: str = "",
) -> Progress:
    """A new pass, at its source's first step. A pod that serves a probed version (``serving``)
    keeps serving while the checkpoint stages; any other pod, and every pod of a pass with
    nothing to stage (a broadcast), leaves traffic in the pass's first write."""
    step = first_step(source)
    stages = step in FLOWS[source].serving_steps
    return Progress(
        refit=refit,
        uid=uid,
        version=version,
        path=path,
        created=created,
        rollback=rollback,
        source=source,
        started=now,
        step=step,
        restarts=restarts,
        incarnation=incarnation,
        serving=serving,
        serving_path=serving_path if serving else "",
        # An adapter pass leaves the base weights serving until its swap, adapter or not.
        left_traffic=0.0 if stages and (serving or FLOWS[source].serves_beside) else now,
        adapter=adapter,
    )


# An adapter record's base_pass when no pass of the base weights was recorded on the pod: any
# base pass that takes the pod out of traffic since unloaded the adapter.
NO_BASE = "-"


def base_key(progress: Progress) -> str:
    """One base-weights pass, as adapter records name the base they were probed on."""
    return f"{progress.uid}@{progress.started}"


@dataclass(frozen=True)
class RunStep:
    step: Step


@dataclass(frozen=True)
class WaitUntil:
    at: float


@dataclass(frozen=True)
class Finished:
    outcome: Outcome


Action = RunStep | WaitUntil | Finished


def next_action(progress: Progress, now: float) -> Action:
    if progress.finished_pass:
        return Finished(progress.outcome)
    if progress.not_before > now:
        return WaitUntil(progress.not_before)
    return RunStep(Step(progress.step))


def staged_adapter_name(name: str, version: str) -> str:
    """The name a new adapter version is loaded and probed under before the swap. Clients
    send ``name``; this one is the pass's own (vLLM takes any string; a name already loaded
    is refused, so a retried load unloads it first)."""
    return f"{name}@{version}"


def step_done(progress: Progress, step: str, seconds: float, now: float) -> Progress:
    """Record ``step`` as done and move on; after ``ready`` the pass has Succeeded."""
    if step != progress.step:
        raise ValueError(f"step {step!r} is not the pending step {progress.step!r}")
    timings = {**progress.step_seconds, step: round(seconds, 4)}
    steps = steps_of(progress.source)
    index = steps.index(step)
    if step == last_step_in_traffic(progress.source) and not progress.left_traffic:
        progress = replace(progress, left_traffic=now)  # the next record drains
    if step == Step.drain:
        progress = replace(progress, drained_at=now)
    if index + 1 == len(steps):
        return replace(
            progress,
            step="",
            attempts=0,
            step_seconds=timings,
            outcome="Succeeded",
            reason="",
            message="",
            finished=now,
            not_before=0.0,
        )
    return replace(
        progress,
        step=steps[index + 1],
        attempts=0,
        step_seconds=timings,
        not_before=0.0,
        reason="",
        message="",
    )


def backoff(attempts: int) -> float:
    return min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** max(attempts - 1, 0))


def step_failed(
    progress: Progress,
    step: str,
    reason: str,
    message: str,
    now: float,
    *,
    retries: int,
    final: bool = False,
    outcome: Outcome = "Failed",
) -> Progress:
    """Record a failed try: retry with exponential backoff up to ``retries`` times, then end
    the pass with ``outcome`` (the pod stays out of traffic with this reason)."""
    attempts = progress.attempts + 1
    ends = final or reason in FINAL_CODES or attempts > retries
    flow = FLOWS[progress.source]
    if ends and flow.restores_while_serving and step in flow.serving_steps:
        # The served adapter was never touched: unload the staged one, serve the old on.
        return replace(
            progress, step=RESTORE, attempts=0, reason=reason, message=message, not_before=0.0
        )
    if step in LOAD_STEPS and reason not in UNTOUCHED_LOAD_CODES:
        progress = replace(progress, touched=True)
    if ends and step in LOAD_STEPS and reason in UNTOUCHED_LOAD_CODES and progress.serving:
        if not progress.touched:
            # Refused before the model was touched, and no earlier try touched it either:
            # put the pod back to serving what it served.
            return replace(
                progress, step=RESTORE, attempts=0, reason=reason, message=message,
                not_before=0.0,
            )  # fmt: skip
        message = (
            f"{message}; an earlier try of this pass may have changed the model, so the pod "
            f"does not go back to serving {progress.serving} unprobed"
        )
    if ends:
        return replace(
            progress,
            attempts=attempts,
            outcome=outcome,
            reason=reason,
            message=message,
            finished=now,
            not_before=0.0,
        )
    return replace(
        progress,
        attempts=attempts,
        reason=reason,
        message=message,
        not_before=now + backoff(attempts),
    )


def resumed(progress: Progress) -> Progress:
    """A pass taken up from its record (an operator restart, or a takeover from a frozen
    leader). Past the stage's record the last driver may have been inside the load when it
    stopped (the load's start is not recorded: that would be a write per pod and pass), so
    the model counts as touched: the pass can still succeed through its probe, but never
    restores the pod unprobed."""
    if progress.finished_pass or progress.step == STEPS[0]:
        return progress
    flow = FLOWS[progress.source]
    if flow.restores_while_serving and progress.step in (*flow.serving_steps, RESTORE):
        return progress  # the served adapter is untouched before the swap
    if progress.step == Step.ready and not progress.process:
        # Probed, but the record does not say which process was (a record written before
        # records named it): probe again rather than vouch for a process nobody probed.
        return replace(progress, touched=True, step=Step.probe, attempts=0, not_before=0.0)
    return replace(progress, touched=True)


def restored(progress: Progress, now: float) -> Progress:
    """The restore step worked: the pass ends Failed (with the load's refusal as its reason),
    and the pod serves ``serving`` again (an adapter pass: the staged adapter is unloaded, and
    the pod serves what it served, the base weights alone if no adapter)."""
    if progress.step != RESTORE:
        raise ValueError(f"step {progress.step!r} is not {RESTORE!r}")
    if progress.touched:
        raise ValueError("a pass whose load may have changed the model is never restored")
    return replace(progress, outcome="Failed", restored=True, finished=now, not_before=0.0)


def out_of_traffic_seconds(progress: Progress) -> float | None:
    """Seconds from the pass taking the pod out of traffic to putting it back: None while it
    is out (or when the pass ended with the pod still out, or never took it out)."""
    back = progress.outcome == "Succeeded" or progress.restored
    if not back or not progress.left_traffic or not progress.finished:
        return None
    return max(0.0, progress.finished - progress.left_traffic)


def probe_judged(progress: Progress, outcome: ProbeOutcome, now: float) -> Progress:
    """A probe verdict ends the pass unless it passed (then ``ready`` is next)."""
    progress = replace(progress, probe=outcome.to_status())
    verdict, reason, message = outcome.verdict, outcome.reason, outcome.message
    if verdict == "Pass":
        return progress
    if progress.step == FLOWS[progress.source].staged_probe:
        # Judged through the staged name: the served adapter is untouched, restore it.
        return replace(progress, step=RESTORE, attempts=0, reason=reason, message=message)
    ended: Outcome = "Failed" if verdict == "Fail" else "Inconclusive"
    return replace(
        progress, outcome=ended, reason=reason, message=message, finished=now, not_before=0.0
    )


def must_record(before: Progress, after: Progress) -> bool:
    """Whether the step that turned ``before`` into ``after`` must be recorded before the pass
    goes on: the pass ended, a try failed (attempts and backoff must survive a restart), or
    the step took the pod out of traffic (the stage of a pod that served through it, an
    adapter's staged probe): that record sets the condition False before the drain pauses the
    pod, and a restart past it resumes at the drain. A step that leaves the pod where it was
    is not recorded: a restart repeats it (a stage or an adapter's staged load again), and
    ``resumed`` counts the model as touched only past the record that took the pod out."""
    if after.finished_pass or after.attempts > before.attempts:
        return True
    return before.in_traffic and not after.in_traffic


def must_read_back(progress: Progress, resumed: bool) -> bool:
    """Whether the pod's weight version must be read back before loading: only when a load of
    this pass may already have run, that is the pass was resumed from a record (an operator
    restart) or an earlier try of the load failed (a timed-out load may still have finished)."""
    return resumed or progress.attempts > 0


@dataclass(frozen=True)
class Readiness:
    """The pod's readiness-gate condition that goes with a pass's progress."""

    ready: bool
    reason: str
    message: str


def readiness(progress: Progress) -> Readiness | None:
    """Out of traffic while the pass runs and after it failed (with the reason: fail closed);
    back in traffic only once it Succeeded, which requires a passed probe, or once a refused
    load left the weights it served untouched. None: leave the condition as it is (a pod
    that serves while the checkpoint stages, or whose staging was refused)."""
    flow = FLOWS[progress.source]
    # "weights", or "adapter <name>": what the pass brings, as the condition names it.
    what = " ".join(w for w in (flow.what, progress.adapter) if w)
    if progress.outcome == "Succeeded":
        kept = f"; {progress.drained}" if progress.drained else ""
        return Readiness(True, Reason.ProbePassed, f"{what} {progress.version} probed{kept}")
    if progress.restored and flow.serves_beside and not progress.serving:
        return Readiness(
            True,
            flow.restored_reason,
            f"{what} {progress.version} refused ({progress.reason}: {progress.message}); the "
            f"pod serves no {what}",
        )
    if progress.restored:
        served = f"{flow.what} " if flow.serves_beside else ""
        return Readiness(
            True,
            flow.restored_reason,
            f"serving {served}{progress.serving} again: {progress.version} refused "
            f"({progress.reason}: {progress.message})",
        )
    if progress.in_traffic:
        return None
    if progress.finished_pass:
        reason = progress.reason or Reason.RefitFailed
        return Readiness(False, reason, f"{reason}: {progress.message}")
    what = "rollback" if progress.rollback else "refit"
    staged = f"; {progress.staging}" if progress.staging else ""  # memory, or why not
    return Readiness(False, Reason.Refitting, f"{what} to {progress.version} in progress{staged}")


def load_needed(read_back_version: str | None, target: str) -> bool:
    """Before a (re)load: the pod already reporting the target version means the load we
    recorded as started finished before a restart; loading again would only repeat risk."""
    return read_back_version != target
