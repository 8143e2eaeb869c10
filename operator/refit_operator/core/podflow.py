"""The per-pod refit sequence as plain data: where a pod stands and what to do next.

A pod's progress is stored on the pod itself (annotation ``refit.rollout.dev/progress``, JSON),
so an operator that restarts resumes at the first step not recorded as done. It is recorded at
the pass's checkpoints only (``must_record``): when the pass starts, once the new weights are
loaded, on every failed try and when the pass ends; a thousand-pod refit would otherwise write
each pod ten times. A restart therefore repeats at most the steps since the last checkpoint,
which is safe because every step is idempotent; the one that is not safe to repeat blindly, the
load, is preceded by a read-back of the pod's weight version whenever it may already have run
(``must_read_back``, ``load_needed``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Literal

from refit_worker.contract import API_GROUP

from . import times
from .api import PodProbe
from .probe import ProbeOutcome
from .reasons import Reason

# Where a pod's record lives on the pod (docs/operator.md).
PROGRESS_ANNOTATION = f"{API_GROUP}/progress"
CLAIM_ANNOTATION = f"{API_GROUP}/claim"
# A LoRA adapter's record (spec.adapter), one per adapter name beside the base weights' own:
# an adapter pass never overwrites the record that the base weights' rollback and
# convergence read. The pod's claim stays one: one pass at a time, whatever it refits.
ADAPTER_PROGRESS_PREFIX = f"{API_GROUP}/adapter-progress."


def progress_annotation(track: str) -> str:
    """The annotation holding a pod's record of ``track`` (WeightRefitSpec.track: "" for the
    base weights, else the adapter's name)."""
    return f"{ADAPTER_PROGRESS_PREFIX}{track}" if track else PROGRESS_ANNOTATION


class Step(StrEnum):
    """Every step a pod's pass can stand at: the word in ``status.pods[].step``, the progress
    annotation and the step metrics (snake_case there). A member's name is its value, as for
    ``Reason``; ``steps.STEP_CODE`` holds the code that runs each."""

    # While the pod still serves: verify the checkpoint (manifest, digests, the model's
    # tensors) and stage its bytes in the worker's memory, so the time out of traffic holds
    # only the swap (docs/concepts.md, "Time out of traffic").
    stage = "stage"
    drain = "drain"  # condition False, drainDelaySeconds, /pause and a bounded wait for in-flight
    sleep = "sleep"
    wakeWeights = "wakeWeights"
    load = "load"  # from the staged bytes, after a cheap check that no file changed since staging
    # A broadcast's load (instead of stage and load): wait until the batch's pods are ready
    # and the trainer announces its send, join its transfer with the rank the operator
    # assigned, receive, check against the manifest, load, finish (docs/broadcast.md).
    receive = "receive"
    wakeKV = "wakeKV"
    resetCache = "resetCache"
    stampVersion = "stampVersion"  # stamp (refit_load already does) and read back the version
    # Read back what the model holds (vLLM's /weight_checker and the buffers' digests) and
    # compare with the pods of the same layout at this version (checksums.py).
    checksum = "checksum"
    probe = "probe"
    ready = "ready"  # vouch for the weights (the pod's readiness probe), then condition True
    # An adapter pass's own (ADAPTER_STEPS).
    loadAdapter = "loadAdapter"  # load the new adapter under its staged name
    probeStaged = "probeStaged"  # probe through the staged name, the pod still serving
    swap = "swap"  # load the verified files in place under the served name
    # Not in any sequence: after a load refused before the model was touched, wake the KV
    # cache and unpause, so the pod serves the weights it had (``Progress.restored``).
    restore = "restore"


# A weights pass (from a checkpoint, or a broadcast's receive).
STEPS: tuple[Step, ...] = (
    Step.stage, Step.drain, Step.sleep, Step.wakeWeights, Step.load, Step.receive, Step.wakeKV,
    Step.resetCache, Step.stampVersion, Step.checksum, Step.probe, Step.ready,
)  # fmt: skip
# A LoRA adapter's pass (spec.adapter; docs/concepts.md, "LoRA adapters"). The base weights
# are never touched: no sleep, wake or reload. While the pod serves the old adapter the new one
# is verified ("stage", the checkpoint's manifest and digest checks), loaded under its staged
# name (``staged_adapter_name``) and probed through that name ("probeStaged"); only then does
# the pod leave traffic, for the swap: "drain" as for weights, "swap" loads the verified files
# in place under the name clients send (vLLM loads the new weights before dropping the old),
# "resetCache" drops prefix blocks computed with the old adapter and resumes, "probe" scores
# through the served name, "ready" vouches and unloads the staged name.
ADAPTER_STEPS: tuple[Step, ...] = (
    Step.stage, Step.loadAdapter, Step.probeStaged, Step.drain, Step.swap, Step.resetCache,
    Step.probe, Step.ready,
)  # fmt: skip
# Before the swap the served adapter is untouched and the pod stays in traffic: a failure
# there unloads the staged name and the old adapter serves on (``Progress.restored``).
ADAPTER_IN_TRAFFIC_STEPS = frozenset({Step.stage, Step.loadAdapter, Step.probeStaged})
# Steps after which the progress is recorded on the pod (besides start, failures and the end):
# the end of staging (of the staged probe, for an adapter) is the write that takes the pod out
# of traffic; a restart past it resumes at the drain, and the load's read-back keeps it from
# loading twice.
CHECKPOINT_STEPS = frozenset({Step.stage, Step.probeStaged})
# Failures that repeating cannot fix: the worker refused the checkpoint, the probe judged.
_FINAL_CODES: frozenset[str] = frozenset(
    {
        Reason.PathNotAllowed,
        Reason.CheckpointMissing,
        Reason.ManifestInvalid,
        Reason.ManifestMismatch,
        Reason.TensorMismatch,
        Reason.ProbeReferenceInvalid,
        Reason.CheckpointChanged,
        Reason.AdapterInvalid,
        Reason.DrafterMissing,
        Reason.WeightChecksumMismatch,  # checksums.judge
    }
)
# Refusals of the load that the worker raises before it touches the model (contract.py): the
# pod still holds the weights it served, so it can go back to serving them.
UNTOUCHED_LOAD_CODES = (_FINAL_CODES - {Reason.ProbeReferenceInvalid}) | {
    # A broadcast refused before its load (refit_worker.broadcast.gloo_engine), or never sent.
    Reason.TransferMismatch,
    Reason.TransferFailed,
    Reason.TrainerTimeout,
}
# The steps that change the weights: a refusal of theirs before the model was touched lets
# the pod go back to what it served.
LOAD_STEPS = frozenset({Step.load, Step.receive})
Source = Literal["checkpoint", "broadcast", "adapter"]
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0

Outcome = Literal["", "Succeeded", "Failed", "Inconclusive"]
RESTORE = Step.restore  # not in STEPS (Step.restore)


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
        return self.adapter if self.source == "adapter" else ""

    @property
    def probe_model(self) -> str | None:
        """The model name the pending probe scores through (None: the served base model)."""
        if self.source != "adapter":
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
        if self.source == "adapter":
            # Before the swap the base weights (and the old adapter, if any) serve on: an
            # adapter's restore only unloads the staged name.
            steps = {*ADAPTER_IN_TRAFFIC_STEPS, RESTORE}
            return self.step in steps and not self.left_traffic
        return bool(self.serving) and self.step == STEPS[0] and not self.left_traffic

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
    """A new pass. A pod that serves a probed version (``serving``) keeps serving while the
    checkpoint stages; any other pod leaves traffic in the pass's first write."""
    return Progress(
        refit=refit,
        uid=uid,
        version=version,
        path=path,
        created=created,
        rollback=rollback,
        source=source,
        started=now,
        restarts=restarts,
        incarnation=incarnation,
        serving=serving,
        serving_path=serving_path if serving else "",
        # An adapter pass leaves the base weights serving until its swap, adapter or not.
        left_traffic=0.0 if serving or source == "adapter" else now,
        adapter=adapter,
    )


def base_key(progress: Progress) -> str:
    """One base-weights pass, as adapter records name the base they were probed on."""
    return f"{progress.uid}@{progress.started}"


@dataclass(frozen=True)
class Claim:
    """Who drives a pod now: one refit pass of one operator replica, with its fencing token.

    Stored on the pod (annotation ``refit.rollout.dev/claim``, JSON) from the pass's first
    write, which takes it with optimistic concurrency (the pod's resourceVersion), to its last
    write, which removes it. Every write of the pass in between is conditional on the claim
    still being this one; every worker call carries ``fence`` (:func:`claim_fence`).

    ``lease`` and ``lease_seconds`` name the Lease the holder leads on (``namespace/name``):
    another operator process, of this installation or another, judges from that Lease
    whether the holder may still act, and takes the pod over only once it cannot. A claim
    written before these fields existed has them empty: judged by the reader's own Lease."""

    refit: str
    uid: str
    fence: int
    holder: str  # the operator replica's identity
    lease: str = ""
    lease_seconds: int = 0

    def to_annotation(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str | None) -> Claim | None:
        if not text:
            return None
        try:
            doc = json.loads(text)
            return cls(
                str(doc["refit"]), str(doc["uid"]), int(doc["fence"]), str(doc["holder"]),
                str(doc.get("lease", "")), int(doc.get("lease_seconds", 0)),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


# A pass's fencing token is FENCE_BASE + the resourceVersion of the pod its claim's write was
# conditional on. The API server takes one claim per resourceVersion of a pod, and every later
# claim is conditional on a version written after it (the earlier claim's own write at least),
# so each claim of a pod carries a higher token than every earlier one, whichever operator
# process, Lease or installation took it: no two drivers ever hold equal tokens, and no Lease
# (re-created or not) restarts them. It relies on resourceVersion being etcd's revision, an
# integer that grows across the cluster, which the API calls opaque (docs/operator.md, "Fencing
# tokens"). FENCE_BASE puts these tokens above every token of the Lease-epoch scheme
# (leaseTransitions << 32 | pass; Lease.next_fence), which a pod may remember from an older
# operator, and an int64 revision below 2**63 keeps them within the pods' 64 bits.
FENCE_BASE = 1 << 63


def claim_fence(resource_version: str) -> int | None:
    """The fencing token of a claim written conditional on the pod's ``resource_version``;
    None when that is not a decimal integer below 2**63 (then the pass takes the Lease-epoch
    token instead)."""
    rv = resource_version
    if not (rv.isascii() and rv.isdigit()) or int(rv) >= FENCE_BASE:
        return None
    return FENCE_BASE + int(rv)


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


def steps_of(source: Source) -> tuple[Step, ...]:
    """The ordered steps of a pass with this weight source."""
    return ADAPTER_STEPS if source == "adapter" else STEPS


def last_step_in_traffic(source: Source) -> Step:
    """The step whose end takes a serving pod out of traffic (the next record drains)."""
    return Step.probeStaged if source == "adapter" else STEPS[0]


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
    ends = final or reason in _FINAL_CODES or attempts > retries
    if ends and progress.source == "adapter" and step in ADAPTER_IN_TRAFFIC_STEPS:
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
    if progress.source == "adapter" and progress.step in (*ADAPTER_IN_TRAFFIC_STEPS, RESTORE):
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
    if progress.source == "adapter" and progress.step == Step.probeStaged:
        # Judged through the staged name: the served adapter is untouched, restore it.
        return replace(progress, step=RESTORE, attempts=0, reason=reason, message=message)
    ended: Outcome = "Failed" if verdict == "Fail" else "Inconclusive"
    return replace(
        progress, outcome=ended, reason=reason, message=message, finished=now, not_before=0.0
    )


def must_record(before: Progress, after: Progress) -> bool:
    """Whether the step that turned ``before`` into ``after`` is a checkpoint to record: the
    pass ended, a try failed (attempts and backoff must survive a restart), or a checkpoint
    step completed."""
    if after.finished_pass or after.attempts > before.attempts:
        return True
    return before.step in CHECKPOINT_STEPS and after.step != before.step


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
    if progress.outcome == "Succeeded":
        kept = f"; {progress.drained}" if progress.drained else ""
        what = f"adapter {progress.adapter}" if progress.source == "adapter" else "weights"
        return Readiness(True, Reason.ProbePassed, f"{what} {progress.version} probed{kept}")
    if progress.restored and progress.source == "adapter" and not progress.serving:
        return Readiness(
            True,
            Reason.PreviousAdapter,
            f"adapter {progress.adapter} {progress.version} refused ({progress.reason}: "
            f"{progress.message}); the pod serves no adapter {progress.adapter}",
        )
    if progress.restored:
        what = "adapter " if progress.source == "adapter" else ""
        return Readiness(
            True,
            Reason.PreviousAdapter if progress.source == "adapter" else Reason.PreviousWeights,
            f"serving {what}{progress.serving} again: {progress.version} refused "
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


def step_applies(step: str, sleep_level: int, source: Source = "checkpoint") -> bool:
    """Whether ``step`` does anything at this sleep level (level 0 skips sleep and wakes) for
    this weight source (a broadcast has nothing to stage or read: it receives instead)."""
    if source == "adapter":
        return step in ADAPTER_STEPS
    if sleep_level == 0 and step in (Step.sleep, Step.wakeWeights, Step.wakeKV):
        return False
    if source == "broadcast":
        return step not in (Step.stage, Step.load)
    return step != Step.receive
