"""Where a refit's weights come from: one module per weight source (checkpoint, broadcast,
adapter) behind one interface (base.WeightSource), which the controller dispatches on once:
``source_for`` a refit's spec, ``SOURCES[progress.source]`` for one pass (a broadcast's rollback
is a checkpoint's pass). The sequence of each source's pass is data in the pure core
(core/sequences.py: ``FLOWS``)."""

from __future__ import annotations

from ...core.api import Sequence, WeightRefitSpec
from ...core.podflow import Progress
from ...core.sequences import Source, Step, step_applies
from ...edges.worker_client import WorkerClient
from ..pass_context import StepRun
from .adapter import ADAPTER
from .base import WeightSource
from .broadcast import BROADCAST
from .checkpoint import CHECKPOINT

SOURCES: dict[Source, WeightSource] = {s.kind: s for s in (CHECKPOINT, BROADCAST, ADAPTER)}


def source_for(spec: WeightRefitSpec) -> WeightSource:
    """The refit's weight source."""
    return SOURCES[spec.source]


async def run_step_code(run: StepRun, step: Step) -> str | Progress:
    """Run ``step``'s code from the table of the pass's source, or nothing where the step does
    not apply at this sleep level and weight source."""
    source = run.progress.source
    if step != Step.restore and not step_applies(step, run.seq.sleep_level, source):
        return ""
    return await SOURCES[source].step_code[step](run)


async def execute_step(
    worker: WorkerClient, seq: Sequence, progress: Progress, step: str, resumed: bool
) -> str:
    """Run one step of the pod sequence outside a pass (the bench's refit cycle, the tests):
    the same code the pass runs, without the pass's peers, rounds or probe reference. Returns
    the stage step's note (how the worker staged the checkpoint) or the drain's (requests a
    ``keep`` drain froze), "" otherwise."""
    done = await run_step_code(StepRun(worker, seq, progress, resumed), Step(step))
    assert isinstance(done, str), f"step {step!r} judges only within a pass"
    return done
