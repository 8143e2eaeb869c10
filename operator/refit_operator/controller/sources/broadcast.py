"""Weights sent by the trainer (spec.broadcast): no stage, no load from files; the pass receives
in a round of the send, over vLLM's weight transfer API, checked against the trainer's promised
manifest (docs/broadcast.md). Its preflight reads that manifest; an operator that restarts reads
it again before its first passes. A rollback loads the checkpoint the pod served."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import ClassVar

from refit_worker import contract
from refit_worker.contract import ContractError, TransferManifest

from ...core import podflow
from ...core.api import Broadcast
from ...core.decision import PodStart
from ...core.podflow import Progress
from ...core.podview import PodView
from ...core.reasons import Problem, Reason
from ...core.sequences import STEPS, Source, Step
from ...edges.cluster import Kube
from ...edges.worker_client import WorkerClient, WorkerError
from ..inputs import read_key
from ..pass_context import BroadcastSource, PassContext, StepCode, StepFailed, StepRun
from ..refit_state import Tick
from ..rounds import Rounds, TrainerTimeout, rank_problem
from ..steps import WEIGHTS_STEP_CODE
from .base import WeightSource, with_drafter


async def _receive_step(run: StepRun) -> str:
    ctx, pod = run.in_pass(Step.receive)
    try:
        await _receive(ctx, pod, run.worker, run.progress, run.resumed)
    finally:
        if ctx.broadcast is not None:
            ctx.broadcast.rounds.leave(pod.name)
    return ""


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
    # The ranks this pod takes: the count its preflight (or admission) had from this process.
    kept = ctx.answers.get(pod)
    workers = kept.world_size if kept is not None and kept.world_size is not None else None
    if workers is None:
        workers = await worker.world_size(timeout=t_step)
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


async def load_manifest(t: Tick, cluster: Kube) -> Problem | None:
    """Read the trainer's transfer manifest from its ConfigMap and check it against the
    spec's digest, before any pod is touched; the passes' source (its rounds) or a problem."""
    view, st = t.view, t.state
    b = view.spec.broadcast
    assert b is not None
    ref = b.manifest.config_map_ref
    text = await read_key(
        cluster, t, "ConfigMap", ref.name, ref.key,
        missing=Reason.ManifestMissing, forbidden=Reason.ManifestForbidden,
    )  # fmt: skip
    if isinstance(text, Problem):
        return text
    try:
        manifest = TransferManifest.from_json_dict(json.loads(text))
    except (ValueError, ContractError) as e:
        return Problem(Reason.ManifestInvalid, f"ConfigMap {ref.name} key {ref.key!r}: {e}")
    if manifest.digest != b.manifest.digest:
        return Problem(
            Reason.ManifestMismatch,
            f"ConfigMap {ref.name} holds the manifest {manifest.digest}, not "
            f"spec.broadcast.manifest.digest {b.manifest.digest}",
        )
    shown = view.status.broadcast.round if view.status.broadcast is not None else 0
    rounds = Rounds(shown, st.wake.set)
    st.broadcast = BroadcastSource(b, manifest.to_json_dict(), rounds)
    return None


class FromBroadcast(WeightSource):
    kind: ClassVar[Source] = "broadcast"
    step_code: ClassVar[Mapping[Step, StepCode]] = {
        **WEIGHTS_STEP_CODE,
        Step.receive: _receive_step,
    }

    def pass_kind(self, start: PodStart) -> Source:
        return "checkpoint" if start.path else "broadcast"  # a rollback loads a checkpoint

    def begin(self, ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
        return with_drafter(ctx, pod, super().begin(ctx, pod, progress))

    async def check(
        self, t: Tick, pods: list[PodView], cluster: Kube, client: Callable[[PodView], WorkerClient]
    ) -> Problem | None:
        return await load_manifest(t, cluster)

    async def ready_to_pass(self, t: Tick, cluster: Kube) -> Problem | None:
        if t.state.broadcast is not None:
            return None
        return await load_manifest(t, cluster)

    def receives(self, pod: PodView, start: PodStart) -> bool:
        """Whether this pass has its receive ahead (a rollback loads a checkpoint; a resumed
        pass may be past its receive)."""
        if start.rollback:
            return False
        p = pod.progress
        if not start.resume or p is None:
            return True
        return p.source == "broadcast" and p.step in STEPS[: STEPS.index(Step.receive) + 1]


BROADCAST = FromBroadcast()
