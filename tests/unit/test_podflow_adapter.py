"""The LoRA adapter pass in the pure core (podflow, source "adapter"): the old adapter serves
until the new one passed its probe under its staged name; a failure before the swap unloads the
staged name and keeps the pod in traffic on the old adapter; after the swap it fails closed."""

from __future__ import annotations

import pytest
from refit_operator.core import podflow
from refit_operator.core.podflow import ADAPTER_STEPS, RESTORE, Progress, RunStep, Step
from refit_operator.core.podview import PodView
from refit_operator.core.probe import ProbeOutcome


def adapter_pass(serving: str = "v1") -> Progress:
    return podflow.start(
        "wr", "uid-1", "v2", "/adapters/v2", now=100.0, serving=serving,
        serving_path="/adapters/v1" if serving else "", source="adapter",
    )  # fmt: skip


def walk_to(p: Progress, step: str, now: float = 101.0) -> Progress:
    while p.step != step:
        p = podflow.step_done(p, p.step, 0.01, now)
    return p


def test_adapter_steps_need_no_sleep_wake_or_reload():
    assert ADAPTER_STEPS == (
        "stage", "loadAdapter", "probeStaged", "drain", "swap", "resetCache", "probe", "ready",
    )  # fmt: skip
    assert not {Step.sleep, Step.wakeWeights, Step.load, Step.wakeKV, Step.stampVersion} & set(
        ADAPTER_STEPS
    )
    for step in ADAPTER_STEPS:
        assert podflow.step_applies(step, 2, "adapter")
    assert not podflow.step_applies(Step.sleep, 1, "adapter")


def test_walk_to_success_leaves_traffic_only_for_the_swap():
    p = adapter_pass()
    in_traffic = []
    for step in ADAPTER_STEPS:
        assert podflow.next_action(p, 101.0) == RunStep(step)
        in_traffic.append(p.in_traffic)
        assert podflow.readiness(p) is None or not p.in_traffic
        p = podflow.step_done(p, step, 0.01, 100.0 + ADAPTER_STEPS.index(step))
    # stage, loadAdapter and probeStaged run while the old adapter serves.
    assert in_traffic == [True, True, True, False, False, False, False, False]
    assert p.outcome == "Succeeded"
    assert p.left_traffic == 102.0  # the end of probeStaged
    assert podflow.out_of_traffic_seconds(p) == 5.0
    ready = podflow.readiness(p)
    assert ready is not None and ready.ready


def test_the_end_of_the_staged_probe_is_recorded():
    p = walk_to(adapter_pass(), Step.probeStaged)
    after = podflow.step_done(p, Step.probeStaged, 0.01, 102.0)
    assert podflow.must_record(p, after)
    assert p.in_traffic and not after.in_traffic  # this record takes the pod out of traffic


@pytest.mark.parametrize("step", [Step.stage, Step.loadAdapter])
def test_refused_before_the_swap_restores_the_old_adapter(step: str):
    p = walk_to(adapter_pass(), step)
    p = podflow.step_failed(p, step, "ManifestMismatch", "digest differs", 103.0, retries=3)
    assert p.step == RESTORE and p.outcome == "" and p.in_traffic
    p = podflow.restored(p, 104.0)
    assert p.outcome == "Failed" and p.restored and p.reason == "ManifestMismatch"
    ready = podflow.readiness(p)
    assert ready is not None and ready.ready and ready.reason == "PreviousAdapter"
    assert "serving adapter v1 again" in ready.message
    assert PodView(
        "p", "10.0.0.1", True, True, False, True, 0, p
    ).serving == "v1"  # fmt: skip


def test_retries_before_the_swap_stay_in_traffic():
    p = walk_to(adapter_pass(), Step.loadAdapter)
    p = podflow.step_failed(p, Step.loadAdapter, "HttpError", "500", 103.0, retries=2)
    assert p.step == Step.loadAdapter and p.attempts == 1 and p.in_traffic


def test_a_failed_staged_probe_restores_the_old_adapter():
    p = walk_to(adapter_pass(), Step.probeStaged)
    p = podflow.probe_judged(p, ProbeOutcome("Fail", "LogprobDrift", "mean over"), 103.0)
    assert p.step == RESTORE and not p.finished_pass
    assert p.probe is not None and p.probe.verdict == "Fail"
    p = podflow.restored(p, 104.0)
    ready = podflow.readiness(p)
    assert ready is not None and ready.ready and "LogprobDrift" in ready.message


def test_a_failed_probe_after_the_swap_fails_closed():
    p = walk_to(adapter_pass(), Step.probe)
    p = podflow.probe_judged(p, ProbeOutcome("Fail", "LogprobDrift", "mean over"), 106.0)
    assert p.outcome == "Failed" and not p.restored
    ready = podflow.readiness(p)
    assert ready is not None and not ready.ready and ready.reason == "LogprobDrift"


def test_a_failed_swap_fails_closed():
    p = walk_to(adapter_pass(), Step.swap)
    p = podflow.step_failed(p, Step.swap, "HttpError", "500", 105.0, retries=0)
    assert p.outcome == "Failed" and not p.restored and not p.in_traffic


def test_a_first_adapter_refused_leaves_the_base_weights_serving():
    """A pod that serves no adapter of this name still serves its base weights: the first
    adapter's pass stages beside them, and refused, the pod never left traffic (issue 41: a
    bad first adapter stranded the fleet)."""
    p = adapter_pass(serving="")
    assert p.in_traffic and p.left_traffic == 0.0
    p = podflow.step_failed(p, Step.stage, "ManifestMismatch", "x", 101.0, retries=0)
    assert p.step == RESTORE and p.in_traffic  # the staged name is still unloaded
    p = podflow.restored(p, 102.0)
    assert p.outcome == "Failed" and p.restored and p.in_traffic
    ready = podflow.readiness(p)
    assert ready is not None and ready.ready and ready.reason == "PreviousAdapter"
    assert "serves no adapter" in ready.message


def test_resumed_before_the_swap_is_untouched_and_after_it_touched():
    before = walk_to(adapter_pass(), Step.probeStaged)
    assert podflow.resumed(before) == before
    after = walk_to(adapter_pass(), Step.resetCache)
    assert podflow.resumed(after).touched


def test_staged_name_is_per_version():
    assert podflow.staged_adapter_name("policy", "step-40") == "policy@step-40"
    assert podflow.staged_adapter_name("policy", "a") != podflow.staged_adapter_name("policy", "b")
