"""The per-pod sequences as data: every step a pass can stand at (``Step``), the ordered steps
of each weight source's pass and what each may do while the pod serves (``Flow``, ``FLOWS``),
and the refusals that end a pass or leave the model untouched. Pure; podflow walks them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from .reasons import Reason


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
# Failures that repeating cannot fix: the worker refused the checkpoint, the probe judged.
FINAL_CODES: frozenset[str] = frozenset(
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
UNTOUCHED_LOAD_CODES = (FINAL_CODES - {Reason.ProbeReferenceInvalid}) | {
    # A broadcast refused before its load (refit_worker.broadcast.gloo_engine), or never sent.
    Reason.TransferMismatch,
    Reason.TransferFailed,
    Reason.TrainerTimeout,
}
# The steps that change the weights: a refusal of theirs before the model was touched lets
# the pod go back to what it served.
LOAD_STEPS = frozenset({Step.load, Step.receive})
Source = Literal["checkpoint", "broadcast", "adapter"]


@dataclass(frozen=True)
class Flow:
    """How a pass of one weight source walks, as data: the sequence and what it may do while
    the pod serves. The pure core reads a pass's flow (``FLOWS[progress.source]``) instead of
    asking which source it is; the code of each source's steps, its preflight inputs and its
    admission live in controller/sources/ (one module per source)."""

    steps: tuple[Step, ...]  # the ordered steps (step_applies skips what does nothing)
    skipped: frozenset[Step]  # steps of ``steps`` this source never runs
    # Steps run while the pod serves what it served, and the last of them: its end is the
    # record that takes the pod out of traffic.
    serving_steps: frozenset[Step]
    last_serving_step: Step
    # In traffic through ``serving_steps`` with nothing of its own served before: the base
    # weights serve on beside a first adapter.
    serves_beside: bool
    # A failure that ends the pass within ``serving_steps`` restores (unloads what it staged):
    # nothing served was touched. (A weights pass restores only a load refused untouched.)
    restores_while_serving: bool
    staged_probe: Step | None  # a probe of what is staged beside what serves
    # The pass reloads the base weights: the reload-safety admission applies (core/admission).
    reloads: bool
    # The stage may run without a claim (no fencing token): Rolling stages the next batch's
    # weights while the current batch is out of traffic, and a pass on a pod that serves
    # stages before its claim, whose write then takes the pod out (pod_pass._stage_unclaimed).
    stages_ahead: bool
    # A finished refit can load its version again into a pod that joins or restarts later
    # (a broadcast's tensors are gone once sent: such a pod waits for the next refit).
    loads_again: bool
    # What the readiness condition calls what the pass brings, and its reason once restored.
    what: str
    restored_reason: Reason


_WEIGHTS = Flow(
    steps=STEPS, skipped=frozenset({Step.receive}), serving_steps=frozenset({STEPS[0]}),
    last_serving_step=STEPS[0], serves_beside=False, restores_while_serving=False,
    staged_probe=None, reloads=True, stages_ahead=True, loads_again=True, what="weights",
    restored_reason=Reason.PreviousWeights,
)  # fmt: skip
FLOWS: dict[Source, Flow] = {
    "checkpoint": _WEIGHTS,
    # A broadcast stages and loads nothing: its weights arrive in the receive.
    "broadcast": replace(
        _WEIGHTS, skipped=frozenset({Step.stage, Step.load}), stages_ahead=False,
        loads_again=False,
    ),
    "adapter": Flow(
        steps=ADAPTER_STEPS, skipped=frozenset(), serving_steps=ADAPTER_IN_TRAFFIC_STEPS,
        last_serving_step=Step.probeStaged, serves_beside=True, restores_while_serving=True,
        staged_probe=Step.probeStaged, reloads=False, stages_ahead=False, loads_again=True,
        what="adapter",
        restored_reason=Reason.PreviousAdapter,
    ),
}  # fmt: skip
RESTORE = Step.restore  # not in STEPS (Step.restore)


def steps_of(source: Source) -> tuple[Step, ...]:
    """The ordered steps of a pass with this weight source."""
    return FLOWS[source].steps


def first_step(source: Source) -> Step:
    """The step a new pass of this weight source starts at: its first that does something (a
    broadcast has nothing to stage, so its pass starts at the drain, out of traffic)."""
    flow = FLOWS[source]
    return next(s for s in flow.steps if s not in flow.skipped)


def last_step_in_traffic(source: Source) -> Step:
    """The step whose end takes a serving pod out of traffic (the next record drains)."""
    return FLOWS[source].last_serving_step


def step_applies(step: str, sleep_level: int, source: Source = "checkpoint") -> bool:
    """Whether ``step`` does anything at this sleep level (level 0 skips sleep and wakes) for
    this weight source (a broadcast has nothing to stage or read: it receives instead)."""
    flow = FLOWS[source]
    if step not in flow.steps or step in flow.skipped:
        return False
    return not (sleep_level == 0 and step in (Step.sleep, Step.wakeWeights, Step.wakeKV))
