"""The drain step (runner.execute_step "drain") per drain mode, against the simulated worker:
``wait`` is bounded by drainTimeoutSeconds (vLLM's /pause?mode=wait answers only once the
requests in flight finished, so its wait is the drain), ``keep`` never waits for the requests
it froze and says how many it kept, ``abort`` and ``wait`` still wait for what /metrics counts.
The same on real vLLM under load: tests/e2e/test_refit_under_load.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from refit_operator import podflow, runner
from refit_operator.api import Sequence
from refit_operator.runner import StepFailed
from refit_operator.worker import WorkerClient, session

from testbed.simfleet import SimPod

ADMIN = "admin"


def progress() -> podflow.Progress:
    return podflow.start("wr", "u1", "B", "/c/B", now=time.time())


async def drain(pod: SimPod, step: str = "drain", **seq: object) -> str:
    async with session() as http:
        worker = WorkerClient(pod.base_url, http=http, admin_token=ADMIN)
        return await runner.execute_step(
            worker, Sequence.model_validate(seq), progress(), step, False
        )


async def test_wait_is_bounded_by_the_drain_timeout_not_the_step_timeout(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """Regression: the pause of a ``wait`` drain ran under the step timeout (120 s by
    default), so a request that outlived drainTimeoutSeconds held the pass for the step
    timeout and then failed as a timeout, never as DrainTimeout."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    pod.set_fault("pause", "delay", 5.0)  # a request in flight for 5 s
    began = time.monotonic()
    with pytest.raises(StepFailed) as failed:
        await drain(pod, drain_mode="wait", drain_timeout_seconds=1, step_timeout_seconds=30)
    assert time.monotonic() - began < 4
    assert failed.value.reason == "DrainTimeout", failed.value
    assert "after 1s" in failed.value.message


async def test_keep_does_not_wait_for_the_requests_it_froze(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """Regression: a ``keep`` drain waited for the frozen requests to leave, which they
    never do while paused: every keep refit under load ended in DrainTimeout."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    pod.set_state(running=3)  # frozen by the pause, still counted by /metrics
    began = time.monotonic()
    note = await drain(pod, drain_mode="keep", drain_timeout_seconds=2)
    assert time.monotonic() - began < 1.5
    assert note == "3 requests kept in flight, to finish on B"
    assert pod.call_log()[-2]["params"] == {"mode": "keep"}
    pod.set_state(running=0)
    assert await drain(pod, drain_mode="keep") == ""


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_abort_and_wait_still_wait_for_what_metrics_counts(
    sim_fleet: Callable[..., list[SimPod]], mode: str
) -> None:
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    pod.set_state(running=1)
    with pytest.raises(StepFailed) as failed:
        await drain(pod, drain_mode=mode, drain_timeout_seconds=1)
    assert failed.value.reason == "DrainTimeout"
    assert failed.value.message == "1 requests still in flight after 1s"
    pod.set_state(running=0)
    assert await drain(pod, drain_mode=mode, drain_timeout_seconds=1) == ""


def test_a_kept_drain_is_said_on_the_readiness_condition() -> None:
    p = progress()
    for step in podflow.STEPS:
        p = podflow.step_done(p, step, 0.1, time.time())
    assert podflow.readiness(p) == podflow.Readiness(True, "ProbePassed", "weights B probed")
    kept = podflow.readiness(replace(p, drained="2 requests kept in flight, to finish on B"))
    assert kept is not None
    assert kept.message == "weights B probed; 2 requests kept in flight, to finish on B"


@pytest.mark.parametrize(
    ("mode", "sleeps"), [("keep", "keep"), ("wait", "abort"), ("abort", "abort")]
)
async def test_sleep_pauses_in_the_drain_mode_keep_or_else_abort(
    sim_fleet: Callable[..., list[SimPod]], mode: str, sleeps: str
) -> None:
    """Regression: /sleep ran in vLLM's default mode, abort, which aborted the requests a keep
    drain had frozen. Otherwise abort, on purpose: what queued since the drain never runs on
    unprobed weights."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    await drain(pod, "sleep", drain_mode=mode)
    assert pod.call_log()[-1]["params"] == {"level": "1", "mode": sleeps}


async def test_keep_resets_the_prefix_cache_of_the_frozen_requests_too(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """Regression: vLLM refused the reset while the requests a keep drain froze held blocks,
    and the pass retried until it gave up (found on real vLLM under load)."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    await drain(pod, "resetCache", drain_mode="keep")
    assert pod.call_log()[-2]["params"] == {"reset_running_requests": "true"}
    await drain(pod, "resetCache", drain_mode="wait")
    assert pod.call_log()[-2]["params"] == {}
