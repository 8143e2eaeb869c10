"""The WeightRefit's spec as typed models: which pods, which weights, how carefully.

Part of the API whose root is api.WeightRefit (api.py says how a field is added and how the CRD
is generated from it). Each field's docstring is its description in the CRD; its default is the
API server's default too; ``Annotated[type, crd(...)]`` adds what only the API server checks.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import Field

from .api_crd import (
    LABEL_KEY_RULE,
    LABEL_VALUE,
    PATH,
    PATH_RULES,
    VERSION_CEL,
    VERSION_RULE,
    ApiModel,
    crd,
    crd_model,
    immutable,
    object_key_rule,
    object_name_rule,
    rule,
)
from .sequences import Source


class LabelSelectorRequirement(ApiModel):
    """One label requirement."""

    model_config = crd_model(
        rule(
            "self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0)"
            " : (!has(self.values) || size(self.values) == 0)",
            "spec.fleet.selector.matchExpressions values must be non-empty for operator In or"
            " NotIn and empty for Exists or DoesNotExist",
        )
    )

    key: Annotated[str, crd(minLength=1, maxLength=317)]
    """The label key the requirement applies to."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key's value is compared with values."""
    values: Annotated[
        list[str],
        crd(maxItems=64, items={"description": "A label value.", "maxLength": 63,
                                "pattern": LABEL_VALUE}),
    ] = Field(default_factory=list)  # fmt: skip
    """Label values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(ApiModel):
    model_config = crd_model(
        rule(
            "(has(self.matchLabels) && size(self.matchLabels) > 0) ||"
            " (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
            "spec.fleet.selector must not be empty; set matchLabels or matchExpressions (an"
            " empty selector would select every pod in the namespace)",
        )
    )

    match_labels: Annotated[
        dict[str, str],
        crd(LABEL_KEY_RULE, maxProperties=32,
            additionalProperties={"maxLength": 63, "pattern": LABEL_VALUE}),
    ] = Field(default_factory=dict)  # fmt: skip
    """Pods must carry every one of these labels (key = value)."""
    match_expressions: Annotated[list[LabelSelectorRequirement], crd(maxItems=16)] = Field(
        default_factory=list
    )
    """Pods must satisfy every one of these label requirements."""

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


class SecretKeyRef(ApiModel):
    name: Annotated[str, crd(object_name_rule("Secret"), minLength=1, maxLength=253)]
    """Name of the Secret."""
    key: Annotated[str, crd(object_key_rule("Secret"), minLength=1, maxLength=253)] = "token"
    """Key within the Secret whose value is the token."""


# The labels LeaderWorkerSet puts on every pod of a group (its group-key hash, and the pod's
# index in the group: 0 for the leader).
LWS_GROUP_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-key"
LWS_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX: Final = "0"


class Groups(ApiModel):
    """A replica that spans several pods (LeaderWorkerSet): the pods sharing the value of
    ``group_label`` are one refit unit, driven through the API of the pod whose
    ``index_label`` is "0" (the leader) and gated together (docs/concepts.md, "Parallel
    layouts and multi-pod replicas")."""

    model_config = crd_model(
        rule(
            "self.groupLabel != self.indexLabel",
            "spec.fleet.groups.groupLabel and indexLabel must be two different labels",
        )
    )

    group_label: Annotated[str, crd(minLength=1, maxLength=317)] = LWS_GROUP_LABEL
    """The label whose value names a pod's group."""
    index_label: Annotated[str, crd(minLength=1, maxLength=317)] = LWS_INDEX_LABEL
    """The label holding a pod's index in its group ("0" for the leader)."""


class Fleet(ApiModel):
    selector: LabelSelector
    """Label selector for the fleet's pods (same namespace). Must not be empty: an empty
    selector would select every pod in the namespace."""
    port: Annotated[int, crd(format="int32", minimum=1, maximum=65535)] = 8000
    """The vLLM HTTP port on each pod (reached at the pod's status.podIP)."""
    admin_token_secret_ref: SecretKeyRef | None = None
    """Secret (same namespace) holding the token the pods' admin guard expects on vLLM's admin
    endpoints (sleep, pause, collective_rpc). Omit when the pods run without the guard."""
    api_key_secret_ref: Annotated[
        SecretKeyRef | None,
        crd(
            properties={"key": {"description": "Key within the Secret whose value is the API key."}}
        ),
    ] = None
    """Secret (same namespace) holding vLLM's own API key (the pods' --api-key), which the probe
    sends on /v1/completions. Omit when the pods serve /v1 without a key."""
    groups: Groups | None = None  # None: every selected pod is a replica of its own
    """Replicas that span several pods (LeaderWorkerSet groups): the selected pods sharing the
    value of groupLabel are one refit unit, driven through the API of the pod whose indexLabel
    is "0" (the leader); every pod of the group is gated on the group's probe, and a restart of
    any pod is the group's restart. Strategies, status and metrics count groups, named by their
    leaders. Omit when every pod is a replica of its own. The defaults are the labels
    LeaderWorkerSet puts on its pods."""


class Checkpoint(ApiModel):
    path: Annotated[str, crd(*PATH_RULES, minLength=1, maxLength=4096)]
    """Absolute path of the checkpoint directory as mounted inside the pods (safetensors files
    plus refit-manifest.json, and refit-probe.json when the probe reference comes from the
    checkpoint). Must lie under the pods' REFIT_ALLOWED_ROOT."""
    version: Annotated[str, crd(VERSION_RULE, minLength=1, maxLength=63)]
    """Weight version stamped into vLLM (GET /weight_info reports it) and used as a label value:
    1-63 letters, digits, '.', '_' or '-', starting and ending with a letter or digit, e.g.
    step-100."""
    format: Literal["safetensors"] = "safetensors"
    """On-disk format of the checkpoint."""


class Adapter(ApiModel):
    """A LoRA adapter to refit on the fleet's pods (docs/concepts.md, "LoRA adapters"): its
    directory (PEFT files, manifest, probe reference) and version, served under ``name``. The
    CRD's CEL rules hold ``name`` to 1-40 letters, digits, '.', '_' or '-' and refuse '@' with
    a message of its own (core.admission.STAGED_SEPARATOR: a pass's staged name is
    ``<name>@<version>``); the preflight refuses a name the pods serve already as another
    model (core.admission.adapter_name_problem)."""

    name: Annotated[
        str,
        crd(
            rule(
                VERSION_CEL,
                "spec.adapter.name must be 1-40 letters, digits, '.', '_' or '-', starting and"
                " ending with a letter or digit",
            ),
            rule(
                "!self.contains('@')",
                "spec.adapter.name must not contain '@'; a pass loads each new version under the"
                " staged name <name>@<version> before the swap",
            ),
            minLength=1,
            maxLength=40,
        ),
    ]
    """The name clients send as the model (`"model": "<name>"`) to be served through the
    adapter: 1-40 letters, digits, '.', '_' or '-', starting and ending with a letter or digit
    (never '@': `<name>@<version>` is the staged name of a pass). It must not be a model name
    the pods serve already other than this adapter (the base model and its aliases, an adapter
    loaded by others): the preflight refuses it (AdapterNameConflict)."""
    path: Annotated[str, crd(*PATH_RULES, minLength=1, maxLength=4096)]
    """Absolute path of the adapter directory as mounted inside the pods (PEFT's
    adapter_config.json and safetensors, refit-manifest.json, and refit-probe.json when the
    probe reference comes from it: scored through the adapter). Must lie under the pods'
    REFIT_ALLOWED_ROOT."""
    version: Annotated[str, crd(VERSION_RULE, minLength=1, maxLength=63)]
    """The adapter's version, as the pods' records and status report it: 1-63 letters, digits,
    '.', '_' or '-', starting and ending with a letter or digit, e.g. step-100."""


class HeldAdapters(ApiModel):
    """What a refit of the base weights does with the LoRA adapters the pods hold (docs/concepts.md,
    "LoRA adapters"): an adapter was probed on the base it served with, and is served on no other
    base unless a probe vouches for it there."""

    on_base_refit: Literal["Unload", "Reprobe"] = "Unload"
    """Unload (the default): the pass unloads every adapter the pod's records name at its drain,
    and each adapter's track needs a refit for the new base (until then the pod serves its base
    model; clients asking for the adapter get vLLM's 404). Reprobe: probe each adapter again on
    the new base against a reference for it, and serve only those that pass. Reprobe is not
    supported yet: a refit that asks for it fails before touching any pod
    (AdapterReprobeUnsupported)."""


class ManifestConfigMapRef(ApiModel):
    name: Annotated[str, crd(minLength=1, maxLength=253)]
    """Name of the ConfigMap."""
    key: Annotated[str, crd(minLength=1, maxLength=253)] = "transfer-manifest.json"
    """Key within the ConfigMap holding the transfer manifest (JSON)."""


class TransferManifestRef(ApiModel):
    config_map_ref: ManifestConfigMapRef
    """ConfigMap (same namespace) holding the transfer manifest, read by the operator at
    preflight; its RBAC must allow get on it."""
    digest: Annotated[
        str,
        crd(
            rule(
                "self.matches(r'^[0-9a-f]{64}$')",
                f"{PATH} must be 64 lowercase hex characters (the manifest's BLAKE3 digest)",
            ),
            maxLength=64,
        ),
    ]
    """The manifest's digest (64 lowercase hex characters, its "blake3" field). A ConfigMap
    holding another manifest fails the refit (ManifestMismatch) before any pod is touched."""


class Rendezvous(ApiModel):
    host: Annotated[
        str,
        crd(rule("isIP(self) && ip(self).family() == 4", f"{PATH} must be an IPv4 address"),
            maxLength=15),
    ]  # fmt: skip
    """IPv4 address the pods reach the trainer at."""
    port: Annotated[int, crd(minimum=1, maximum=65535)]
    """TCP port of the trainer's rendezvous store (the same for every round)."""


class Broadcast(ApiModel):
    """Weights the trainer sends (docs/broadcast.md) instead of a checkpoint directory."""

    version: Annotated[str, crd(VERSION_RULE, minLength=1, maxLength=63)]
    """Weight version stamped into vLLM once the pod loaded the broadcast (GET /weight_info
    reports it): 1-63 letters, digits, '.', '_' or '-', starting and ending with a letter or
    digit."""
    engine: Literal["refit-gloo"] = "refit-gloo"
    """The vLLM weight transfer engine the pods were started with (--weight-transfer-config
    backend): refit-gloo (torch.distributed gloo over TCP, CPU or GPU pods, with the manifest
    check)."""
    rendezvous: Rendezvous
    """Where the trainer (rank 0) opens its rendezvous store (a TCPStore); every pod must reach
    it there, and every other pod of its round on gloo's ports."""
    manifest: TransferManifestRef
    """What the trainer promises to send: a transfer manifest (every tensor's name, dtype, shape
    and BLAKE3 digest; docs/formats.md) in a ConfigMap, and its digest here, which the operator
    checks the ConfigMap against before any pod is touched."""
    timeout_seconds: Annotated[int, crd(minimum=1, maximum=86400)] = 600
    """Seconds a pod waits for the trainer to announce its round, and the limit on the
    rendezvous and on each transfer operation (gloo's timeout, on the pods and the trainer). The
    operator also waits at most this plus sequence.stepTimeoutSeconds for a pod to receive,
    check and load the whole round: size it for the model's bytes at the network's speed."""


# spec.sequence.drainDelaySeconds at most (the CRD's maximum says the same): long enough for
# any endpoint propagation lag, short enough that a pass never sits on it unnoticed.
DRAIN_DELAY_MAX_SECONDS: Final = 300


class Sequence(ApiModel):
    drain_mode: Literal["wait", "abort", "keep"] = "wait"
    """What happens to requests in flight when a pod is paused: wait lets them finish (up to
    drainTimeoutSeconds), abort cancels them, keep freezes them and resumes them after the
    refit."""
    # The CRD says it with bounds rather than an enum of integers (the same values).
    sleep_level: Annotated[Literal[0, 1, 2], crd(enum=None, minimum=0, maximum=2)] = 1
    """vLLM sleep level during the reload: 0 frees nothing, 1 offloads the old weights to CPU
    memory (a failed reload can fall back to them), 2 discards them (the reload must complete)."""
    step_timeout_seconds: Annotated[int, crd(minimum=1)] = 120
    """Time limit for every single HTTP step on a pod (pause, sleep, wake, reset, stamp)."""
    drain_timeout_seconds: Annotated[int, crd(minimum=1)] = 60
    """Time limit for a pod's requests in flight to drain when drainMode is wait."""
    # Seconds from the pass taking the pod out of traffic (its record's left_traffic) to the
    # drain's pause: the pod keeps serving what endpoints that have not yet dropped it send.
    # Strict: a whole number of seconds, never a bool, a fraction or a numeric string.
    drain_delay_seconds: int = Field(default=0, ge=0, le=DRAIN_DELAY_MAX_SECONDS, strict=True)
    """Seconds from the pass taking a pod out of traffic (its readiness condition set False) to
    the drain's pause, during which the pod keeps serving what reaches it: set it to the time
    your Service endpoints, kube-proxy and gateways take to drop a pod that is no longer Ready,
    so that no request reaches the pod once paused (those are aborted cleanly, for the client to
    retry). Measured from the pass's record, so a pass resumed after an operator restart does
    not wait again. It adds to each pod's time out of traffic and counts toward
    totalTimeoutSeconds, not drainTimeoutSeconds."""
    load_timeout_seconds: Annotated[int, crd(minimum=1)] = 600
    """Time limit for each of a pod's stage (checkpoint verification and staging) and reload. A
    broadcast's receive is bounded by broadcast.timeoutSeconds instead."""
    probe_timeout_seconds: Annotated[int, crd(minimum=1)] = 60
    """Time limit for a pod's logprob probe."""
    total_timeout_seconds: Annotated[int, crd(minimum=1)] = 3600
    """Time limit for the whole refit, from start to the last pod; then it fails."""
    retries: Annotated[int, crd(minimum=0, maximum=10)] = 2
    """Retries of a failed step on a pod, with backoff, before the pod counts as failed."""


class Strategy(ApiModel):
    type: Literal["AllAtOnce", "Rolling"] = "AllAtOnce"
    """AllAtOnce refits every pod together (the synchronous RL barrier: the whole fleet switches
    between two training steps). Rolling refits at most maxUnavailable pods at a time while the
    rest keep serving."""
    max_unavailable: Annotated[
        int | str,
        crd(
            rule(
                "type(self) == int ? self >= 1 : self.matches(r'^(100|[1-9][0-9]?)%$')",
                f"{PATH} must be an integer of at least 1 or a percentage from 1% to 100%",
            )
        ),
    ] = "25%"
    """Rolling only: how many pods may be out of traffic at once, as a count (at least 1) or a
    percentage of the fleet from 1% to 100% (rounded down, but at least one pod)."""
    canary: Annotated[int, crd(minimum=0)] = 0
    """Pods refitted and probed first; the rest start only when every canary passed. 0 means no
    canary."""


class ConfigMapKeyRef(ApiModel):
    name: Annotated[str, crd(object_name_rule("ConfigMap"), minLength=1, maxLength=253)]
    """Name of the ConfigMap."""
    key: Annotated[str, crd(object_key_rule("ConfigMap"), minLength=1, maxLength=253)] = (
        "refit-probe.json"
    )
    """Key within the ConfigMap holding the probe reference document."""


class ProbeReferenceSource(ApiModel):
    model_config = crd_model(
        rule(
            "(has(self.source) && self.source == 'ConfigMap') == has(self.configMapRef)",
            "spec.probe.reference.configMapRef is required when source is ConfigMap and must be"
            " omitted when source is Checkpoint",
        )
    )

    source: Literal["Checkpoint", "ConfigMap"] = "Checkpoint"
    """Checkpoint reads refit-probe.json from the checkpoint directory on the pod; ConfigMap
    reads it from configMapRef (required for a broadcast, which has no directory)."""
    config_map_ref: ConfigMapKeyRef | None = None
    """ConfigMap (same namespace) holding refit-probe.json; only with source ConfigMap."""


class Thresholds(ApiModel):
    # Defaults suit bf16 serving against an fp32 reference: measured max |Δlogprob| of
    # 0.02-0.03 on a tiny Llama (measured on vLLM 0.32 CPU), so 0.5 on the worst token
    # and 0.05 on the mean leave headroom while a wrong checkpoint moves NLL by far more.
    mean_abs_logprob_diff: Annotated[float, crd(minimum=0)] = 0.05
    """Largest allowed mean over tokens of |logprob(pod) - logprob(reference)|."""
    max_abs_logprob_diff: Annotated[float, crd(minimum=0)] = 0.5
    """Largest allowed |logprob(pod) - logprob(reference)| of any single token."""
    nll_diff: Annotated[float, crd(minimum=0)] = 0.05
    """Largest allowed |NLL(pod) - NLL(reference)|, NLL being the mean negative logprob."""
    pod_agreement: Annotated[float, crd(minimum=0)] = 0.02
    """Largest allowed spread (max - min) of NLL across the fleet's pods at the same version."""
    # A pod whose vLLM runs a drafter with weights of its own: the smallest greedy acceptance
    # of its drafts on the probe prompts (probe.judge_drafter). 1.00 measured for a drafter on
    # the target's weights, 0.32-0.46 for a stale one (tiny model, vLLM 0.32 CPU).
    min_draft_acceptance: float = Field(default=0.5, ge=0.0, le=1.0)
    """Pods whose vLLM runs a speculative drafter with weights of its own (refitted with the
    target from the checkpoint's drafter/): the smallest share of drafted tokens the target must
    accept while it decodes the probe prompts greedily, from vLLM's own spec-decode counters. A
    drafter holding the weights it was trained with for this target drafts as the target
    decodes; a stale or corrupted one does not (measured on the tiny model drafting for itself:
    1.00 fresh, 0.32-0.46 stale). Set it from your own drafter's acceptance at a good refit
    (status.pods[].probe.draftAcceptance); 0 turns the check off."""


class ProbeSpec(ApiModel):
    reference: ProbeReferenceSource = Field(default_factory=ProbeReferenceSource)
    """Where the probe prompts and reference logprobs (refit-probe.json) come from."""
    thresholds: Thresholds = Field(default_factory=Thresholds)
    """A pod passes its probe only when every difference stays within these bounds (natural-log
    units)."""
    failure_limit: Annotated[int, crd(minimum=0)] = 0
    """Failed pods tolerated before the whole refit fails (they stay out of traffic)."""
    inconclusive_limit: Annotated[int, crd(minimum=0)] = 0
    """Pods with an inconclusive probe (no data, NaN, timeout) tolerated before the refit fails
    (they stay out of traffic)."""


class WeightRefitSpec(ApiModel):
    model_config = crd_model(
        rule(
            "[has(self.checkpoint), has(self.broadcast), has(self.adapter)]"
            ".filter(x, x).size() == 1",
            "set exactly one weight source, spec.checkpoint (a checkpoint directory the pods"
            " read), spec.broadcast (weights the trainer sends) or spec.adapter (a LoRA adapter"
            " directory the pods read)",
        ),
        rule(
            "has(oldSelf.checkpoint) == has(self.checkpoint)"
            " && has(oldSelf.adapter) == has(self.adapter)",
            "the weight source (spec.checkpoint, spec.broadcast or spec.adapter) is immutable"
            " after creation; create a new WeightRefit",
        ),
        rule(
            "!has(self.adapter) || !has(self.adapters)",
            "spec.adapters applies to a refit of the base weights (spec.checkpoint or"
            " spec.broadcast), not to an adapter refit",
        ),
        rule(
            "!has(self.broadcast) || (has(self.probe) && has(self.probe.reference) &&"
            " has(self.probe.reference.source) && self.probe.reference.source == 'ConfigMap')",
            "spec.broadcast needs spec.probe.reference.source ConfigMap (a broadcast has no"
            " checkpoint directory to read refit-probe.json from)",
        ),
    )

    fleet: Annotated[Fleet, immutable("to refit another fleet")]
    """The vLLM pods to refit: selected by labels in the WeightRefit's namespace. Immutable
    after creation; create a new WeightRefit for another fleet."""
    # Exactly one weight source (the CRD's CEL rule says so; a model built in a test may not).
    checkpoint: Annotated[Checkpoint | None, immutable("to load another checkpoint")] = None
    """The weights to load, from a checkpoint directory the pods read (set this or broadcast,
    not both). Immutable after creation: a new checkpoint is a new WeightRefit, so every refit's
    history stays truthful."""
    broadcast: Annotated[Broadcast | None, immutable("for another broadcast")] = None
    """Weights the trainer sends over the network instead of a checkpoint directory (set this or
    checkpoint, not both; docs/broadcast.md): the operator takes each batch of pods through
    drain, sleep and wake, assigns them ranks, and reports the batch in status.broadcast with
    the condition ReceiversReady; the trainer then announces the round (annotation
    refit.rollout.dev/broadcast-sending) and sends once per batch. Each pod checks what arrived
    against the manifest before loading it. Needs probe.reference.source ConfigMap. A broadcast
    cannot be loaded again: it is never a rollback target and does not bring pods that join
    later to its version. Immutable after creation."""
    adapter: Annotated[Adapter | None, immutable("to load another adapter")] = None
    """A LoRA adapter to refit on every pod of the fleet instead of the base weights (set this,
    checkpoint or broadcast: exactly one; docs/concepts.md, "LoRA adapters"). The base model is
    never slept or reloaded: each pod verifies the adapter, loads and probes it under a staged
    name while the old adapter serves, then swaps it in under `name` (out of traffic only for
    the swap and the probe through `name`); a refused or failed adapter leaves the old one
    serving. The pods need vLLM's runtime LoRA routes (--enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). Adapter refits of one name are a fleet of their own,
    with their own queue, history and rollback target, beside the refits of the base weights.
    Immutable after creation."""
    # None: Unload (HeldAdapters' default); only a refit of the base weights may set it.
    adapters: Annotated[HeldAdapters | None, immutable("to treat the adapters otherwise")] = None
    """A refit of the base weights (checkpoint or broadcast) only: what it does with the LoRA
    adapters the pods hold. Omitted: they are unloaded, and each adapter needs a refit for the
    new base. Immutable after creation."""
    sequence: Annotated[
        Sequence,
        immutable(
            "for another sequence", why=" (the preflight admitted the pods for this sequence)"
        ),
    ] = Field(default_factory=Sequence)
    """How each pod is taken through the refit sequence, and how long each step may take.
    Immutable after creation: the preflight admits the pods for this sequence (sleepLevel 2 is
    refused where it is unsafe), and every pass of the refit runs the sequence it admitted
    (status.sequence), even one changed past an older CRD."""
    strategy: Strategy = Field(default_factory=Strategy)
    """Which pods are refitted when."""
    probe: ProbeSpec = Field(default_factory=ProbeSpec)
    """The check that lets a pod back into traffic: its prompt logprobs on fixed token ids,
    compared with a reference computed for this checkpoint."""
    on_failure: Literal["Halt", "Rollback"] = "Halt"
    """What to do when the refit fails: Halt stops and keeps failed pods out of traffic;
    Rollback reloads into every pod this refit touched the checkpoint that pod served before it
    (a pod that served none, or a broadcast, leaves traffic)."""
    queue_policy: Literal["Queue", "LatestWins"] = "Queue"
    """When another refit of the same fleet is still running: Queue waits for it; LatestWins
    supersedes every older refit that has not started yet."""
    allow_unsafe_backends: bool = False
    """Refit pods whose image does not report every reload-safety capability (its attention
    backends may keep stale scales after a reload). Leave false unless you know the model avoids
    those backends."""
    # None: kept until the fleet's history limit drops it (history.py).
    ttl_seconds_after_finished: Annotated[int | None, crd(minimum=0)] = None
    """Seconds after the refit finished (status.completionTime) until the operator deletes it,
    like a Job's. 0 deletes it as soon as it finishes. Unset: it is kept until the operator's
    per-fleet history limit (--history-limit, default 10) drops it. The fleet's newest Succeeded
    refit (the convergence target) and its newest checkpoint refit the fleet served (the
    rollback target; the same one unless the newest was a broadcast) are never deleted, whatever
    this says."""

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
    def source(self) -> Source:
        """Where the weights come from: the one source the CRD lets a refit name (what the
        controller dispatches on once: controller/sources/)."""
        if self.broadcast is not None:
            return "broadcast"
        return "adapter" if self.adapter is not None else "checkpoint"

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
