"""Every reason the operator reports, by name, and the Problem value that carries one.

A reason is the CamelCase word a user meets in a refit's condition or message, a pod's
``status.pods[].reason`` and readiness condition, an Event's reason or a metric's label; each
is explained in docs/troubleshooting.md (tests/unit/test_api_reference_reasons.py holds the
two in step, and finds no reason written as a bare literal elsewhere). Phases are not reasons:
they are ``api.Phase`` and ``api.PodPhase``.

A member's name is its value, so the word a user reports is the word to grep for. ``Reason``
is a ``StrEnum``: a member is the plain string wherever it is serialized (JSON, f-strings,
metric labels), so the stored documents read as they did when reasons were literals.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    # --- the fleet preflight: the refit fails before touching any pod
    NoPodsSelected = "NoPodsSelected"  # the fleet's selector matches no pod
    MissingReadinessGate = "MissingReadinessGate"  # a pod lacks the weights-ready gate
    PodNotRunning = "PodNotRunning"  # a pod is not Running or has no IP
    PodUnreachable = "PodUnreachable"  # a pod did not answer (also a step's transport failure)
    GroupLeaderMissing = "GroupLeaderMissing"  # a pod group without exactly one leader
    GroupLabelMissing = "GroupLabelMissing"  # a pod without the group's labels (spec.fleet.groups)
    UnsafeBackend = "UnsafeBackend"  # the image lacks a reload-safety capability
    UnsafeConfiguration = "UnsafeConfiguration"  # a configuration the backports do not cover
    AdapterUnsupported = "AdapterUnsupported"  # an adapter refit on vLLM without runtime LoRA
    # an adapter refit's name is a model the pods serve already and not this track's adapter
    # (the base model or one of its aliases in /v1/models, or an adapter loaded by others)
    AdapterNameConflict = "AdapterNameConflict"
    # spec.adapters.onBaseRefit Reprobe: probing held adapters on a new base is not built yet
    AdapterReprobeUnsupported = "AdapterReprobeUnsupported"
    UnsafeSleepLevel = "UnsafeSleepLevel"  # sleep level 2 would discard the KV cache scales
    ParallelLayoutMismatch = "ParallelLayoutMismatch"  # the pods report different TP/PP/DP
    # a pod runs workers whose answers the refit never hears: /get_world_size counts more
    # than refit_info's layout, or data parallelism behind one API server
    WorkersOutOfReach = "WorkersOutOfReach"
    # a worker joined a broadcast at a rank or world size other than its round's
    BroadcastWorldSizeMismatch = "BroadcastWorldSizeMismatch"
    SecretMissing = "SecretMissing"  # the named Secret or key does not exist
    SecretForbidden = "SecretForbidden"  # RBAC forbids reading the named Secret
    ProbeUnauthorized = "ProbeUnauthorized"  # the pods answered the probe's /v1 with 401/403
    ReferenceInvalid = "ReferenceInvalid"  # the probe reference is missing or malformed
    ReferenceVersionMismatch = (
        "ReferenceVersionMismatch"  # a ConfigMap reference of another version
    )
    ReferenceUnscorable = "ReferenceUnscorable"  # a pod answers 4xx scoring the reference
    ManifestMissing = "ManifestMissing"  # the broadcast's manifest ConfigMap or key is absent
    ManifestForbidden = "ManifestForbidden"  # RBAC forbids reading the manifest ConfigMap
    # --- the gate: the refit stops
    FailureLimitExceeded = "FailureLimitExceeded"  # more pods failed than failureLimit
    InconclusiveLimitExceeded = "InconclusiveLimitExceeded"  # more inconclusive than allowed
    TotalTimeoutExceeded = "TotalTimeoutExceeded"  # the refit ran past totalTimeoutSeconds
    NoRollbackTarget = "NoRollbackTarget"  # a touched pod served no checkpoint to go back to
    RollbackFailed = "RollbackFailed"  # a pod could not be brought back by the rollback
    RolledBack = "RolledBack"  # the rollback finished (also the phase of that name)
    # --- conditions of a refit
    AsExpected = "AsExpected"  # Degraded: nothing is degraded
    PodsFailedWithinLimits = "PodsFailedWithinLimits"  # Degraded: Succeeded with some pods failed
    PodsMovedOn = "PodsMovedOn"  # Superseded: newer refits drove every one of its pods
    ReceiversReady = "ReceiversReady"  # a round's pods wait at receive for the trainer's send
    Joining = "Joining"  # a round's pods are still on their way to receive
    RoundDone = "RoundDone"  # every pod of the last round is past its receive
    NoRound = "NoRound"  # no pod has started towards a transfer yet
    RefitFinished = "RefitFinished"  # the refit reached a final phase: no more sends
    # --- the worker's rejection codes (refit_worker.contract.REJECTION_CODES)
    PathNotAllowed = "PathNotAllowed"  # outside the allowed root, '..', a symlink escape
    CheckpointMissing = "CheckpointMissing"  # the directory or its manifest is absent
    ManifestInvalid = "ManifestInvalid"  # a manifest unreadable or not of the contract
    ManifestMismatch = "ManifestMismatch"  # the bytes (or the spec's digest) differ from it
    TensorMismatch = "TensorMismatch"  # a parameter absent, or of another shape or dtype
    ProbeReferenceInvalid = "ProbeReferenceInvalid"  # the worker cannot read refit-probe.json
    CheckpointChanged = "CheckpointChanged"  # a file changed between stage and load
    AdapterInvalid = "AdapterInvalid"  # a LoRA adapter's adapter_config.json is not PEFT LoRA
    AdapterRankTooHigh = "AdapterRankTooHigh"  # a LoRA adapter's rank above --max-lora-rank
    AdapterModulesUnknown = "AdapterModulesUnknown"  # it targets modules the model lacks
    AdapterBaseMismatch = "AdapterBaseMismatch"  # its matrices do not fit the served model's
    DrafterMissing = "DrafterMissing"  # the pod runs a drafter; the refit carries none
    LoadFailed = "LoadFailed"  # vLLM's reload raised: the model may be half loaded
    TransferMismatch = "TransferMismatch"  # a broadcast's bytes differ from its promise
    TransferFailed = "TransferFailed"  # a broadcast's transport broke before it was complete
    # --- a pod's step: talking to the pod
    WorkerProtocolError = "WorkerProtocolError"  # an answer of the wrong shape
    WorkerHttpError = "WorkerHttpError"  # an unexpected HTTP status
    WorkerRejected = "WorkerRejected"  # a refusal without a contract code
    VersionMismatch = "VersionMismatch"  # the stamped version did not read back
    # the read-back of the runtime weights differs from its peers' or the recorded one
    WeightChecksumMismatch = "WeightChecksumMismatch"
    ContainerRestarted = "ContainerRestarted"  # the container restarted: its weights are gone
    FleetChanged = "FleetChanged"  # the pod's labels moved it into another fleet
    PodDeleted = "PodDeleted"  # the pod was deleted while the refit ran
    TrainerTimeout = "TrainerTimeout"  # no announced, ready round within the broadcast's timeout
    # A step that did not answer in time: ``<Step>Timeout`` (``step_timeout``).
    StageTimeout = "StageTimeout"
    DrainTimeout = "DrainTimeout"  # also: requests still running, or the pod still Ready
    SleepTimeout = "SleepTimeout"
    WakeWeightsTimeout = "WakeWeightsTimeout"
    LoadTimeout = "LoadTimeout"
    ReceiveTimeout = "ReceiveTimeout"
    WakeKVTimeout = "WakeKVTimeout"
    ResetCacheTimeout = "ResetCacheTimeout"
    StampVersionTimeout = "StampVersionTimeout"
    ChecksumTimeout = "ChecksumTimeout"
    ProbeTimeout = "ProbeTimeout"  # also the probe's own scoring request
    ReadyTimeout = "ReadyTimeout"
    RestoreTimeout = "RestoreTimeout"
    # A LoRA adapter pass's own steps (sequences.ADAPTER_STEPS).
    LoadAdapterTimeout = "LoadAdapterTimeout"
    ProbeStagedTimeout = "ProbeStagedTimeout"
    SwapTimeout = "SwapTimeout"
    # --- the probe's verdicts
    ProbePassed = "ProbePassed"  # within every threshold (also the readiness reason then)
    LogprobDrift = "LogprobDrift"  # per-token logprobs differ from the reference's
    NllDrift = "NllDrift"  # the NLL differs from the reference's
    PodDisagreement = "PodDisagreement"  # the NLL differs from the passed peers' median
    ProbeGarbage = "ProbeGarbage"  # logprobs above 0, the wrong count, an unparseable answer
    ProbeNoData = "ProbeNoData"  # no logprobs came back
    DraftAcceptanceLow = "DraftAcceptanceLow"  # the drafter's drafts are not the target's
    DraftNoData = "DraftNoData"  # the drafter drafted nothing while the probe decoded
    ProbeNaN = "ProbeNaN"  # NaN or inf logprobs
    # --- a pod's readiness condition
    PreviousWeights = "PreviousWeights"  # back in traffic on the weights it served before
    PreviousAdapter = "PreviousAdapter"  # the old LoRA adapter serves on after a refused pass
    RefitFailed = "RefitFailed"  # out of traffic after a failed pass without a reason of its own
    Refitting = "Refitting"  # out of traffic while its pass runs
    # --- the one gate over everything a pod serves (core/gate.py)
    NotProbed = "NotProbed"  # no pass has probed the pod's base weights
    MemberNotRunning = "MemberNotRunning"  # a pod of the group is not running (Pending, gone)
    MemberReplaced = "MemberReplaced"  # a pod of the group is not the one the record names
    # An adapter refit whose pods' base weights moved on to another version: unloaded there
    BaseChanged = "BaseChanged"
    # --- Events of a pod's pass
    PodStepRetry = "PodStepRetry"  # a step failed and will be tried again
    PodStepFailed = "PodStepFailed"  # a step failed for good
    PodRefitFailed = "PodRefitFailed"  # the pod's pass ended Failed
    PodRefitInconclusive = "PodRefitInconclusive"  # the pod's pass ended Inconclusive


def step_timeout(step: str) -> Reason:
    """The reason of a step that did not answer in time: ``<Step>Timeout``."""
    return Reason(f"{step[0].upper()}{step[1:]}Timeout")


def pass_event(outcome: str) -> Reason:
    """The Event of a pod's pass that ended ``outcome`` (Failed or Inconclusive)."""
    return Reason(f"PodRefit{outcome}")


@dataclass(frozen=True)
class Problem:
    """Why something was refused or failed: a reason (a ``Reason``, or the worker's rejection
    code, which is one) and a message for people."""

    reason: str
    message: str
