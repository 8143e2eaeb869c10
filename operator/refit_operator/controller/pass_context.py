"""What a pod's pass and its steps share: the pass's context (PassContext: the refit, its
spec, the pods' clients and peers, the broadcast's source), one try of one step (StepRun), the
signature of a step's code (StepCode) and a step's own refusal (StepFailed)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from refit_worker.contract import ProbeReference

from ..core import checksums, preflight_cache
from ..core.api_spec import Broadcast, Sequence, WeightRefitSpec
from ..core.podflow import Progress
from ..core.podview import PodView
from ..core.reasons import Problem
from ..core.sequences import Step
from ..edges.cluster import ClaimedPod, Kube
from ..edges.worker_client import WorkerClient
from .rounds import Rounds


class StepFailed(Exception):
    """A step's own verdict (not a transport error): reason is a Reason."""

    def __init__(self, reason: str, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.final = final


@dataclass(frozen=True)
class BroadcastSource:
    """A broadcast refit's weight source: the spec, the trainer's manifest (read from its
    ConfigMap and checked against the spec's digest by the fleet preflight), the rounds."""

    spec: Broadcast
    manifest: dict[str, object]
    rounds: Rounds


@dataclass
class PassContext:
    """What one pass needs beyond the pod: shared by all passes of one reconcile loop."""

    cluster: Kube
    namespace: str
    refit_doc: dict[str, object]  # for Events
    refit_name: str
    refit_uid: str
    refit_created: str
    fleet: str
    spec: WeightRefitSpec
    client: Callable[[PodView, int | None], WorkerClient]  # (pod, fencing token)
    next_fence: Callable[[], int]  # the fallback token (claim.claim_fence)
    reference: Callable[[str, WorkerClient], Awaitable[ProbeReference]]
    peer_nlls: Callable[[str], list[float]]
    # The pods' read-backs (as listed, and of the passes in flight, which put theirs as they
    # go: under AllAtOnce a pod that read back a moment ago is a peer already), and the
    # checksum the refit's status recorded for (version, layout), if any.
    readbacks: checksums.Readbacks = field(default_factory=checksums.Readbacks)
    recorded_checksum: Callable[[str, str], str | None] = lambda v, lay: None
    # Pods the fleet preflight admitted: name -> the process it admitted
    # (preflight_cache.Identity). The same process is not asked for its refit_info again.
    admitted: Mapping[str, preflight_cache.Identity] = field(default_factory=dict)
    # What earlier preflights and admissions of the fleet's pods kept (core/preflight_cache):
    # a late pod's admission judges a process it holds answers of without asking it again.
    answers: preflight_cache.FleetAnswers = field(default_factory=preflight_cache.FleetAnswers)
    # Pods whose vLLM runs LoRA (refit_info.max_lora_rank > 0), as the preflight or a late
    # pod's admission found them: their probes score one prompt per request, as a batch of
    # prompt-logprob sequences kills vLLM 0.32's LoRA-enabled CPU engine. Added to by passes,
    # which record it (Progress.lora) for their probe.
    lora: set[str] = field(default_factory=set)
    # Pods whose vLLM runs a drafter with weights of its own: name -> its method
    # (refit_info.drafter), as the preflight or a late pod's admission found them; a pass
    # records it (Progress.drafter) and its probe judges the drafter.
    drafters: dict[str, str] = field(default_factory=dict)
    # The layout the preflight found the fleet in (status.layout): a pod that joins later
    # must share it.
    layout: str = ""
    live: dict[str, Progress] = field(default_factory=dict)  # pod -> its pass's progress now
    broadcast: BroadcastSource | None = None  # spec.broadcast: the passes receive from it
    # Why spec.broadcast has no source now: its manifest ConfigMap, read
    # again after an operator restart, is gone or changed. No pass can receive: new broadcast
    # passes are refused like an admission problem, a resumed one fails at its receive.
    source_problem: Problem | None = None
    # The Lease this operator process leads on (``namespace/name``) and its seconds: written
    # into each claim, so that other processes judge from it whether this one may still act.
    lease: str = ""
    lease_seconds: int = 0


@dataclass
class StepRun:
    """One try of one step: what its code reads, and the progress it may amend on the way
    (the checksum records the layout it read back, whether or not its peers agree)."""

    worker: WorkerClient
    seq: Sequence
    progress: Progress
    resumed: bool  # taken up from a record: a load of this pass may already have run
    # The pass around the step; None where the bench or a test runs a step alone (the steps
    # that need the pass's peers, rounds or probe reference cannot run so).
    ctx: PassContext | None = None
    pod: PodView | None = None
    claimed: ClaimedPod | None = None  # the pass's hold of the pod (None: a step run alone)

    def in_pass(self, step: Step) -> tuple[PassContext, PodView]:
        if self.ctx is None or self.pod is None:
            raise ValueError(f"step {step!r} runs only within a pass")
        return self.ctx, self.pod

    @property
    def t_step(self) -> float:
        return float(self.seq.step_timeout_seconds)

    @property
    def t_load(self) -> float:
        return float(self.seq.load_timeout_seconds)


# A step's code: a note on its success (how the stage held the checkpoint, what the drain left
# in flight; "" for none), or the progress the step judged itself (the probe's verdict).
StepCode = Callable[[StepRun], Awaitable[str | Progress]]
