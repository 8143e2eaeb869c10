"""Weights from a checkpoint directory (spec.checkpoint): the pass stages the files while the
pod serves, then, out of traffic, loads the staged bytes (docs/concepts.md, "Weight sources")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ...core import podflow
from ...core.podflow import Progress
from ...core.podview import PodView
from ...core.sequences import Source, Step
from ..pass_context import PassContext, StepCode, StepRun
from ..steps import WEIGHTS_STEP_CODE
from .base import WeightSource, with_drafter


async def _stage(run: StepRun) -> str:
    staged = await run.worker.stage(run.progress.path, timeout=run.t_load)
    return str(staged.get("note", ""))[:200]


async def _load(run: StepRun) -> str:
    progress = run.progress
    # Never reload blindly: a load that finished before a restart stamped the version.
    if podflow.must_read_back(progress, run.resumed):
        info = await run.worker.refit_info(timeout=run.t_step)
        if not podflow.load_needed(info.weight_version, progress.version):
            return ""
    await run.worker.load(progress.path, progress.version, timeout=run.t_load)
    return ""


class FromCheckpoint(WeightSource):
    kind: ClassVar[Source] = "checkpoint"
    step_code: ClassVar[Mapping[Step, StepCode]] = {
        **WEIGHTS_STEP_CODE,
        Step.stage: _stage,
        Step.load: _load,
    }

    def begin(self, ctx: PassContext, pod: PodView, progress: Progress) -> Progress:
        return with_drafter(ctx, pod, super().begin(ctx, pod, progress))


CHECKPOINT = FromCheckpoint()
