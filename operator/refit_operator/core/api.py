"""The WeightRefit API as typed models: the spec the operator reads, the status it writes.

Defaults mirror crds/weightrefit.yaml (the API server applies them; the models apply the same
ones so plain-data unit tests and a CR read back from the server mean the same thing).
tests/unit/test_api.py holds the two in step.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from refit_worker.contract import API_GROUP

VERSION = "v1alpha1"
PLURAL = "weightrefits"
KIND = "WeightRefit"

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


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, object]:
        """The camelCase JSON document the API server stores (unset optionals left out)."""
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


# --------------------------------------------------------------------------------- spec
class LabelSelectorRequirement(_Model):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(_Model):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether a pod with ``labels`` is selected (Kubernetes label-selector semantics)."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for e in self.match_expressions:
            present = e.key in labels
            if e.operator == "In" and not (present and labels[e.key] in e.values):
                return False
            if e.operator == "NotIn" and present and labels[e.key] in e.values:
                return False
            if e.operator == "Exists" and not present:
                return False
            if e.operator == "DoesNotExist" and present:
                return False
        return True

    def canonical(self) -> str:
        """The selector as a kubectl label-selector string: the fleet's identity."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for e in sorted(self.match_expressions, key=lambda e: (e.key, e.operator)):
            if e.operator == "Exists":
                parts.append(e.key)
            elif e.operator == "DoesNotExist":
                parts.append(f"!{e.key}")
            else:
                op = "in" if e.operator == "In" else "notin"
                parts.append(f"{e.key} {op} ({','.join(sorted(e.values))})")
        return ",".join(parts)


class SecretKeyRef(_Model):
    name: str
    key: str = "token"


# The labels LeaderWorkerSet puts on every pod of a group (its group-key hash, and the pod's
# index in the group: 0 for the leader).
LWS_GROUP_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-key"
LWS_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX: Final = "0"


class Groups(_Model):
    """A replica that spans several pods (LeaderWorkerSet): the pods sharing the value of
    ``group_label`` are one refit unit, driven through the API of the pod whose
    ``index_label`` is "0" (the leader) and gated together (docs/concepts.md, "Parallel
    layouts and multi-pod replicas")."""

    group_label: str = LWS_GROUP_LABEL
    index_label: str = LWS_INDEX_LABEL


class Fleet(_Model):
    selector: LabelSelector
    port: int = 8000
    admin_token_secret_ref: SecretKeyRef | None = None
    api_key_secret_ref: SecretKeyRef | None = None
    groups: Groups | None = None  # None: every selected pod is a replica of its own


class Checkpoint(_Model):
    path: str
    version: str
    format: Literal["safetensors"] = "safetensors"


class Adapter(_Model):
    """A LoRA adapter to refit on the fleet's pods (docs/concepts.md, "LoRA adapters"): its
    directory (PEFT files, manifest, probe reference) and version, served under ``name``. The
    CRD's CEL rules hold ``name`` to 1-40 letters, digits, '.', '_' or '-' and refuse '@' with
    a message of its own (core.admission.STAGED_SEPARATOR: a pass's staged name is
    ``<name>@<version>``); the preflight refuses a name the pods serve already as another
    model (core.admission.adapter_name_problem)."""

    name: str
    path: str
    version: str


class ManifestConfigMapRef(_Model):
    name: str
    key: str = "transfer-manifest.json"


class TransferManifestRef(_Model):
    config_map_ref: ManifestConfigMapRef
    digest: str


class Rendezvous(_Model):
    host: str
    port: int


class Broadcast(_Model):
    """Weights the trainer sends (docs/broadcast.md) instead of a checkpoint directory."""

    version: str
    engine: Literal["refit-gloo"] = "refit-gloo"
    rendezvous: Rendezvous
    manifest: TransferManifestRef
    timeout_seconds: int = 600


# spec.sequence.drainDelaySeconds at most (the CRD's maximum says the same): long enough for
# any endpoint propagation lag, short enough that a pass never sits on it unnoticed.
DRAIN_DELAY_MAX_SECONDS: Final = 300


class Sequence(_Model):
    drain_mode: Literal["wait", "abort", "keep"] = "wait"
    sleep_level: Literal[0, 1, 2] = 1
    step_timeout_seconds: int = 120
    drain_timeout_seconds: int = 60
    # Seconds from the pass taking the pod out of traffic (its record's left_traffic) to the
    # drain's pause: the pod keeps serving what endpoints that have not yet dropped it send.
    # Strict: a whole number of seconds, never a bool, a fraction or a numeric string.
    drain_delay_seconds: int = Field(default=0, ge=0, le=DRAIN_DELAY_MAX_SECONDS, strict=True)
    load_timeout_seconds: int = 600
    probe_timeout_seconds: int = 60
    total_timeout_seconds: int = 3600
    retries: int = 2


class Strategy(_Model):
    type: Literal["AllAtOnce", "Rolling"] = "AllAtOnce"
    max_unavailable: int | str = "25%"
    canary: int = 0


class ConfigMapKeyRef(_Model):
    name: str
    key: str = "refit-probe.json"


class ProbeReferenceSource(_Model):
    source: Literal["Checkpoint", "ConfigMap"] = "Checkpoint"
    config_map_ref: ConfigMapKeyRef | None = None


class Thresholds(_Model):
    # Defaults suit bf16 serving against an fp32 reference: measured max |Δlogprob| of
    # 0.02-0.03 on a tiny Llama (measured on vLLM 0.32 CPU), so 0.5 on the worst token
    # and 0.05 on the mean leave headroom while a wrong checkpoint moves NLL by far more.
    mean_abs_logprob_diff: float = 0.05
    max_abs_logprob_diff: float = 0.5
    nll_diff: float = 0.05
    pod_agreement: float = 0.02
    # A pod whose vLLM runs a drafter with weights of its own: the smallest greedy acceptance
    # of its drafts on the probe prompts (probe.judge_drafter). 1.00 measured for a drafter on
    # the target's weights, 0.32-0.46 for a stale one (tiny model, vLLM 0.32 CPU).
    min_draft_acceptance: float = Field(default=0.5, ge=0.0, le=1.0)


class ProbeSpec(_Model):
    reference: ProbeReferenceSource = Field(default_factory=ProbeReferenceSource)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    failure_limit: int = 0
    inconclusive_limit: int = 0


class WeightRefitSpec(_Model):
    fleet: Fleet
    # Exactly one weight source (the CRD's CEL rule says so; a model built in a test may not).
    checkpoint: Checkpoint | None = None
    broadcast: Broadcast | None = None
    adapter: Adapter | None = None
    sequence: Sequence = Field(default_factory=Sequence)
    strategy: Strategy = Field(default_factory=Strategy)
    probe: ProbeSpec = Field(default_factory=ProbeSpec)
    on_failure: Literal["Halt", "Rollback"] = "Halt"
    queue_policy: Literal["Queue", "LatestWins"] = "Queue"
    allow_unsafe_backends: bool = False
    # Seconds after the refit finished (status.completionTime) until the operator deletes it;
    # None: kept until the fleet's history limit drops it (history.py). Like a Job's.
    ttl_seconds_after_finished: int | None = None

    @property
    def version(self) -> str:
        """The version this refit brings the pods to, whatever its source."""
        if self.broadcast is not None:
            return self.broadcast.version
        if self.adapter is not None:
            return self.adapter.version
        assert self.checkpoint is not None, "a WeightRefit names a weight source"
        return self.checkpoint.version

    @property
    def path(self) -> str:
        """The checkpoint (or adapter) directory; "" for a broadcast (nothing to read again)."""
        if self.adapter is not None:
            return self.adapter.path
        return self.checkpoint.path if self.checkpoint is not None else ""

    @property
    def track(self) -> str:
        """The weights this refit replaces: the base model's ("") or one LoRA adapter's (its
        name). Each track has its own queue, history, rollback target and pod records: an
        adapter refit neither waits for nor supersedes a refit of the base weights, and the
        pod's claim alone keeps their passes from overlapping."""
        return self.adapter.name if self.adapter is not None else ""

    @property
    def fleet_label(self) -> str:
        """The fleet as the metrics' ``fleet`` label names it: the canonical selector, with the
        adapter for an adapter refit, whose series (target version, skew, pods out of
        traffic) are the adapter's, beside the base weights' of the same pods."""
        fleet = self.fleet.selector.canonical()
        return f"{fleet} adapter={self.track}" if self.track else fleet


_PERCENT = re.compile(r"^(\d{1,3})%$")


def max_unavailable_count(value: int | str, total: int) -> int:
    """Resolve maxUnavailable against the fleet size; at least 1 so a refit always moves."""
    if isinstance(value, int):
        n = value
    else:
        m = _PERCENT.match(value.strip())
        if m is None:
            n = int(value)
        else:
            # Percentages round down, as Deployments do for maxUnavailable.
            n = total * int(m.group(1)) // 100
    return max(1, min(n, max(total, 1)))


# ------------------------------------------------------------------------------- status
class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class PodProbe(_Model):
    verdict: Verdict
    nll: float = 0.0
    reference_nll: float = 0.0
    mean_abs_logprob_diff: float = 0.0
    max_abs_logprob_diff: float = 0.0
    tokens: int = 0
    draft_acceptance: float | None = None  # a pod with a drafter: its greedy acceptance


class PodResult(_Model):
    name: str
    phase: PodPhase = "Pending"
    step: str = ""
    version: str = ""
    reason: str = ""
    message: str = ""
    attempts: int = 0
    start_time: str = ""
    completion_time: str = ""
    step_seconds: dict[str, float] = Field(default_factory=dict)
    probe: PodProbe | None = None
    # The read-back checksum of the pod's runtime weights (checksums.py), "" before its read.
    checksum: str = ""
    # Seconds from the pass taking the pod out of traffic to putting it back (readiness
    # condition False -> True); None while it is out, or when the pass left it out.
    out_of_traffic_seconds: float | None = None


class Previous(_Model):
    version: str = ""
    path: str = ""
    refit: str = ""


class VersionChecksum(_Model):
    """The read-back checksum pods of one layout served a version with (checksums.py)."""

    version: str
    layout: str
    digest: str


class ProbeSummary(_Model):
    passed: int = 0
    failed: int = 0
    inconclusive: int = 0
    worst_mean_abs_logprob_diff: float = 0.0
    worst_max_abs_logprob_diff: float = 0.0
    worst_nll_diff: float = 0.0
    nll_spread: float = 0.0


class OutOfTrafficSummary(_Model):
    """Time out of traffic over the pods this refit put back into traffic (traffic.py)."""

    pods: int = 0  # pods measured: taken out of traffic and put back by this refit's passes
    worst_seconds: float = 0.0
    median_seconds: float = 0.0
    worst_pod: str = ""


RoundState = Literal["Joining", "Ready", "Sending", "Done"]
# The trainer's announcement on the WeightRefit: "I listen for round N" (the round's number).
SENDING_ANNOTATION = f"{API_GROUP}/broadcast-sending"


class BroadcastRound(_Model):
    """The current batch of a broadcast refit, as the trainer reads it (docs/broadcast.md)."""

    round: int = 0
    world_size: int = 0
    receivers: int = 0
    state: RoundState = "Joining"


class WeightRefitStatus(_Model):
    phase: Phase = "Pending"
    observed_generation: int = 0
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    target_pods: int = 0
    updated_pods: int = 0
    failed_pods: int = 0
    inconclusive_pods: int = 0
    previous: Previous | None = None
    fleet: str = ""
    queue_position: int = 0
    start_time: str = ""
    completion_time: str = ""
    probe_summary: ProbeSummary = Field(default_factory=ProbeSummary)
    # The agreed read-back checksum per (version, layout), at most STATUS_CHECKSUMS_LIMIT.
    checksums: list[VersionChecksum] = Field(default_factory=list)
    out_of_traffic: OutOfTrafficSummary = Field(default_factory=OutOfTrafficSummary)
    # Only the pods that need a person's attention, worst first, at most STATUS_PODS_LIMIT;
    # every pod's full record is its progress annotation (see status.pod_results).
    pods: list[PodResult] = Field(default_factory=list)
    pods_omitted: int = 0  # pods needing attention left out of ``pods`` by the limit
    broadcast: BroadcastRound | None = None  # spec.broadcast only
    # spec.sequence as the preflight admitted it: the refit's passes run this one
    # (admission.admitted_spec), whatever the spec says later.
    sequence: Sequence | None = None
    # The parallel layout the preflight found the fleet's pods in ("TP2 PP1 DP1"): a pod that
    # joins the fleet later must share it (admission.joins_layout).
    layout: str = ""
