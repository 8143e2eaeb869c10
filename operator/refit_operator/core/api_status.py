"""The WeightRefit's status as typed models: what the operator observed and did.

Part of the API whose root is api.WeightRefit (api.py says how a field is added and how the CRD
is generated from it). Only the operator writes the status, whole, so the CRD gives it no
defaults; each field's docstring is its description there.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from .api_crd import CONDITION_REASON, CONDITION_TYPE, ApiModel, crd, crd_model
from .api_spec import Sequence

Phase = Literal[
    "Pending",
    "Queued",
    "Preflight",
    "Progressing",
    "Succeeded",
    "Failed",
    "Halted",
    "RollingBack",
    "RolledBack",
    "Superseded",
]
TERMINAL_PHASES: frozenset[Phase] = frozenset(
    {"Succeeded", "Failed", "Halted", "RolledBack", "Superseded"}
)
PodPhase = Literal[
    "Pending", "InProgress", "Succeeded", "Failed", "Inconclusive", "Dropped", "RolledBack"
]
Verdict = Literal["Pass", "Fail", "Inconclusive"]
# status.pods lists at most this many pods (the CRD's maxItems says the same): the object
# stays a few KiB at any fleet size, far below etcd's 1.5 MiB request limit, and 50 is more
# than a person reads in `kubectl get -o yaml`; `kubectl refit status` shows every pod.
STATUS_PODS_LIMIT: Final = 50
# status.checksums: one read-back digest per (version, layout); a refit has its version and
# its rollback's, each in as many layouts as the fleet mixes (tensor-parallel sizes, dtypes).
STATUS_CHECKSUMS_LIMIT: Final = 8


class Condition(ApiModel):
    """One aspect of the refit's state (metav1.Condition)."""

    # metav1.Condition's required fields (the operator always writes all five).
    model_config = crd_model(required=["type", "status", "lastTransitionTime", "reason", "message"])

    type: Annotated[str, crd(maxLength=316, pattern=CONDITION_TYPE)]
    """Type of condition in CamelCase, e.g. Ready."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: Annotated[str, crd(minLength=1, maxLength=1024, pattern=CONDITION_REASON)]
    """Programmatic CamelCase reason for the last transition."""
    message: Annotated[str, crd(maxLength=32768)] = ""
    """Human-readable details of the last transition."""
    last_transition_time: Annotated[str, crd(format="date-time")] = ""
    """When the condition last changed status."""
    observed_generation: Annotated[int, crd(format="int64", minimum=0)] = 0
    """The metadata.generation the condition was set for."""


class PodProbe(ApiModel):
    # The CRD never required the verdict (the operator always writes one).
    model_config = crd_model(required=[])

    verdict: Verdict
    """Pass, Fail or Inconclusive."""
    nll: float = 0.0
    """The pod's NLL on the probe tokens (mean negative logprob)."""
    reference_nll: float = 0.0
    """The reference NLL on the same tokens."""
    mean_abs_logprob_diff: float = 0.0
    """Mean over tokens of |logprob(pod) - logprob(reference)|."""
    max_abs_logprob_diff: float = 0.0
    """Largest single-token |logprob(pod) - logprob(reference)|."""
    tokens: int = 0
    """Probe tokens compared."""
    draft_acceptance: float | None = None  # a pod with a drafter: its greedy acceptance
    """A pod with a speculative drafter: the share of drafted tokens the target accepted while
    it decoded the probe prompts greedily (absent for a pod without one)."""


class PodResult(ApiModel):
    """One pod's progress and result."""

    name: str
    """Pod name."""
    phase: PodPhase = "Pending"
    """Where this pod stands."""
    step: str = ""
    """Current or last step: stage, drain, sleep, wakeWeights, load (a checkpoint) or receive (a
    broadcast), wakeKV, resetCache, stampVersion, checksum, probe, ready, or restore (a refused
    load or receive put the pod back on the weights it served)."""
    version: str = ""
    """Weight version read back from the pod."""
    reason: str = ""
    """CamelCase reason when the pod did not succeed."""
    message: str = ""
    """Details for a person."""
    attempts: int = 0
    """Attempts made for the current step."""
    start_time: str = ""
    """When the operator started on this pod (RFC 3339; empty until then)."""
    completion_time: str = ""
    """When this pod reached a final phase (RFC 3339; empty until then)."""
    step_seconds: dict[str, float] = Field(default_factory=dict)
    """Seconds each finished step took, keyed by step name."""
    probe: PodProbe | None = None
    """This pod's probe result."""
    checksum: str = ""  # checksums.py
    """The read-back checksum of the pod's runtime weights after its load (empty before the
    checksum step)."""
    out_of_traffic_seconds: float | None = None
    """Seconds from this pod's pass taking it out of traffic (readiness condition False) to
    putting it back (True); absent while it is out, or when the pass left it out."""


class Previous(ApiModel):
    version: str = ""
    """Weight version the fleet served before this refit."""
    path: str = ""
    """Checkpoint path of that version."""
    refit: str = ""
    """Name of the WeightRefit that loaded it."""


class VersionChecksum(ApiModel):
    """The read-back checksum pods of one layout served a version with."""

    # checksums.py computes and compares it.

    version: str
    """The weight version."""
    layout: str
    """A short hash of the dtype and the sorted tensor keys."""
    digest: str
    """SHA-256 over every tensor's digest (first 128 bits, hex)."""


class ProbeSummary(ApiModel):
    passed: int = 0
    """Pods whose probe passed."""
    failed: int = 0
    """Pods whose probe failed."""
    inconclusive: int = 0
    """Pods whose probe was inconclusive."""
    worst_mean_abs_logprob_diff: float = 0.0
    """Largest per-pod mean |logprob difference| against the reference."""
    worst_max_abs_logprob_diff: float = 0.0
    """Largest single-token |logprob difference| against the reference."""
    worst_nll_diff: float = 0.0
    """Largest |NLL(pod) - NLL(reference)|."""
    nll_spread: float = 0.0
    """Max minus min NLL across the probed pods."""


class OutOfTrafficSummary(ApiModel):
    """Time out of traffic over the pods this refit put back into traffic (traffic.py)."""

    pods: int = 0  # pods measured: taken out of traffic and put back by this refit's passes
    """Pods measured (taken out of traffic and put back by this refit)."""
    worst_seconds: float = 0.0
    """The longest time out of traffic of a measured pod, in seconds."""
    median_seconds: float = 0.0
    """The median time out of traffic of the measured pods, in seconds."""
    worst_pod: str = ""
    """The pod that was out of traffic longest."""


RoundState = Literal["Joining", "Ready", "Sending", "Done"]


class BroadcastRound(ApiModel):
    """The current batch of a broadcast refit, as the trainer reads it (docs/broadcast.md)."""

    round: int = 0
    """Number of the round (1, 2, ...), one send by the trainer each."""
    world_size: int = 0
    """The trainer plus this round's receiving pods (0 while Joining)."""
    receivers: int = 0
    """Pods of this round."""
    state: RoundState = "Joining"
    """Joining (pods on their way to the transfer), Ready (waiting for the trainer), Sending
    (the trainer announced this round), Done (every pod of the round is past its receive)."""


class WeightRefitStatus(ApiModel):
    phase: Phase = "Pending"
    """Where the refit stands."""
    observed_generation: Annotated[int, crd(format="int64")] = 0
    """The metadata.generation this status describes."""
    message: str = ""
    """One sentence about the current state."""
    conditions: Annotated[list[Condition], crd(list_map_keys=["type"])] = Field(
        default_factory=list
    )
    """Standard conditions Ready (True only when Succeeded), Progressing and Degraded; for a
    broadcast refit also ReceiversReady (True while a round's pods wait for the trainer's send,
    see status.broadcast)."""
    target_pods: int = 0
    """Pods of the fleet this refit covers."""
    updated_pods: int = 0
    """Pods at the target version whose probe passed."""
    failed_pods: int = 0
    """Pods whose refit or probe failed."""
    inconclusive_pods: int = 0
    """Pods whose probe was inconclusive (no data, NaN, timeout)."""
    previous: Previous | None = None
    """The fleet's state before this refit: the most recent WeightRefit of the same fleet that
    loaded a checkpoint the fleet served (Succeeded, or Superseded because every pod moved on to
    newer refits); never a broadcast. A rollback takes each pod back to the checkpoint that pod
    served, from its own record."""
    fleet: str = ""
    """The fleet's canonical label selector, its identity for queueing and metrics."""
    queue_position: int = 0
    """While Queued, how many refits of this fleet are ahead of this one."""
    start_time: str = ""
    """When the operator started working on the pods (RFC 3339; empty until then)."""
    completion_time: str = ""
    """When the refit reached a final phase (RFC 3339; empty until then)."""
    probe_summary: ProbeSummary = Field(default_factory=ProbeSummary)
    """Probe results over every pod this refit probed (not only those listed in pods)."""
    # The agreed read-back checksum per (version, layout), at most STATUS_CHECKSUMS_LIMIT.
    checksums: Annotated[list[VersionChecksum], crd(maxItems=STATUS_CHECKSUMS_LIMIT)] = Field(
        default_factory=list
    )
    """The read-back checksum of the runtime weights (vLLM's weight checker over the parameters,
    the worker's digests of the other buffers), one per version and layout (dtype and tensor
    keys, which include the parallel ranks) that this refit's pods served with a passed probe. A
    pod of that version and layout whose read-back differs fails with WeightChecksumMismatch
    before its probe. Newest first, at most 8 entries."""
    out_of_traffic: OutOfTrafficSummary = Field(default_factory=OutOfTrafficSummary)
    """Time out of traffic, the cost of a refit to the rollouts: per pod, the seconds from its
    pass setting the readiness condition refit.rollout.dev/weights-ready False to setting it
    True again, over every pod this refit put back into traffic (not only those listed in pods).
    A pod still out of traffic, or left out by a failed pass, is not measured."""
    # Only the pods that need a person's attention, worst first, at most STATUS_PODS_LIMIT;
    # every pod's full record is its progress annotation (see status.pod_results).
    pods: Annotated[list[PodResult], crd(maxItems=STATUS_PODS_LIMIT, list_map_keys=["name"])] = (
        Field(default_factory=list)
    )
    """The pods that need a person's attention, worst first: Failed, Inconclusive, Dropped, then
    InProgress, each group by name; at most 50 entries, the rest counted in podsOmitted. Pods
    that succeeded or rolled back are not listed, so the object stays small at any fleet size.
    Every pod's full record of its last pass is its refit.rollout.dev/progress annotation;
    `kubectl refit status NAME` shows every pod of the fleet."""
    pods_omitted: int = 0  # pods needing attention left out of ``pods`` by the limit
    """Pods needing attention that pods leaves out because of its 50-entry limit (their records
    are on the pods: the refit.rollout.dev/progress annotation)."""
    broadcast: BroadcastRound | None = None  # spec.broadcast only
    """The current round of a broadcast refit (spec.broadcast): a batch of pods that receives
    one send. When the ReceiversReady condition is True for a round it has not sent yet, the
    trainer opens its rendezvous with this world size (itself rank 0, the pods ranks 1 to
    worldSize-1), annotates the WeightRefit refit.rollout.dev/broadcast-sending with the round's
    number, and sends."""
    # spec.sequence as the preflight admitted it: the refit's passes run this one
    # (admission.admitted_spec), whatever the spec says later.
    sequence: Annotated[Sequence | None, crd(record_of="spec.sequence")] = None
    """The sequence the preflight admitted the pods for (spec.sequence as it was then), recorded
    when the refit starts: every pass of the refit runs it, whatever spec.sequence says later."""
    # The parallel layout the preflight found the fleet's pods in ("TP2 PP1 DP1"): a pod that
    # joins the fleet later must share it (admission.joins_layout).
    layout: str = ""
    """The parallel layout the preflight found the fleet's pods in ("TP2 PP1 DP1"), recorded
    when the refit starts: a pod that joins the fleet later is refused (ParallelLayoutMismatch)
    unless it runs the same."""
