"""One interface for every weight source: what the controller asks of where a refit's weights
come from. The controller dispatches once (``sources.source_for``); each source is one module
beside this one (checkpoint, broadcast, adapter), holding its step-code table, the inputs its
preflight reads, its admission of a late pod, and what its pass records. The sequence of its
pass stays data, in the pure core (core/sequences.py: its ``Flow``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import ClassVar

from ...core.decision import PodStart
from ...core.podflow import Progress
from ...core.podview import PodView
from ...core.reasons import Problem
from ...core.sequences import FLOWS, Flow, Source, Step
from ...edges.cluster import Kube
from ...edges.worker_client import WorkerClient
from ..pass_context import PassContext, StepCode
from ..refit_state import Tick


class WeightSource:
    """A weight source as the controller sees it. Subclasses set ``kind`` and ``step_code``
    and override the hooks their source needs; the defaults do nothing."""

    kind: ClassVar[Source]
    # The code of every step a pass of this source runs (core/sequences.py orders them).
    step_code: ClassVar[Mapping[Step, StepCode]]

    @property
    def flow(self) -> Flow:
        return FLOWS[self.kind]

    def pass_kind(self, start: PodStart) -> Source:
        """The source of one pass of a refit of this source (a rollback may load from another:
        a broadcast's rollback loads the checkpoint the pod served)."""
        return self.kind

    def begin(self, ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
        """What a new pass's record holds beyond the common fields: whether the pod runs LoRA
        (its probe then scores one prompt per request: a batch kills vLLM 0.32's LoRA-enabled
        CPU engine), recorded so a pass resumed after a restart knows it too."""
        return replace(progress, lora=pod.name in ctx.lora)

    async def check(
        self, t: Tick, pods: list[PodView], cluster: Kube, client: Callable[[PodView], WorkerClient]
    ) -> Problem | None:
        """The inputs the fleet preflight reads for this source, checked before any pod is
        touched (before the probe reference); a problem refuses the refit."""
        return None

    async def admit(
        self, ctx: PassContext, pod: PodView, worker: WorkerClient, t_step: float
    ) -> Problem | None:
        """A pod that joins after the preflight, checked as the preflight checked the others
        (after refit_info and the world size), before its pass's claim takes it."""
        return None

    async def ready_to_pass(self, t: Tick, cluster: Kube) -> Problem | None:
        """Before the first passes of an operator that did not run the preflight (a restart):
        read again what this source's passes need; a problem fails each pass."""
        return None

    def receives(self, pod: PodView, start: PodStart) -> bool:
        """Whether this pass joins a round of a send (a broadcast's receive is ahead of it)."""
        return False


def with_drafter(ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
    """A weights pass records the pod's drafter with weights of its own (refit_info.drafter):
    its probe also judges the drafter's greedy acceptance, a resumed pass's too."""
    return replace(progress, drafter=ctx.drafters.get(pod.name, ""))
