"""The drain step (steps.execute_step "drain") per drain mode, against the simulated worker:
``wait`` is bounded by drainTimeoutSeconds (vLLM's /pause?mode=wait answers only once the
requests in flight finished, so its wait is the drain), ``keep`` never waits for the requests
it froze and says how many it kept, ``abort`` and ``wait`` end with the pause (never on
/metrics, which a paused engine stops refreshing), and no pause before ``drainDelaySeconds``
have passed since the pass took the pod out of traffic.
The same on real vLLM under load: tests/e2e/test_refit_under_load.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from refit_operator.controller import steps
from refit_operator.controller.pass_context import StepFailed
from refit_operator.core import podflow
from refit_operator.core.api import Sequence
from refit_operator.core.podflow import Step
from refit_operator.edges.leader import LeadershipLost
from refit_operator.edges.worker_client import WorkerClient, session

from testbed.simfleet import SimPod

ADMIN = "admin"


def progress() -> podflow.Progress:
    return podflow.start("wr", "u1", "B", "/c/B", now=time.time())


async def drain(
    pod: SimPod,
    step: Step = Step.drain,
    *,
    record: podflow.Progress | None = None,
    before_call: Callable[[], None] | None = None,
    **seq: object,
) -> str:
    async with session() as http:
        worker = WorkerClient(pod.base_url, http=http, admin_token=ADMIN, before_call=before_call)
        return await steps.execute_step(
            worker, Sequence.model_validate(seq), record or progress(), step, False
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
    pauses = [c["params"] for c in pod.call_log() if c["step"] == "pause"]
    assert pauses == [{"mode": "keep"}]
    pod.set_state(running=0)
    assert await drain(pod, drain_mode="keep") == ""


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_abort_and_wait_trust_the_pause_not_the_stale_metrics(
    sim_fleet: Callable[..., list[SimPod]], mode: str
) -> None:
    """Regression: after the pause the drain waited until /metrics counted nothing. A paused
    vLLM keeps the counts its last step published, and those include requests that reached
    it after the pause began (queued, never run while paused): the drain then waited out
    drainTimeoutSeconds (bench under_load: 60.4 s). The pause is the drain; the sleep step
    aborts what queued since."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    pod.set_state(running=1, waiting=3)  # what the stale stats still say
    began = time.monotonic()
    assert await drain(pod, drain_mode=mode, drain_timeout_seconds=5) == ""
    assert time.monotonic() - began < 2
    assert pod.call_log()[-1]["params"] == {"mode": mode}


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
    await drain(pod, Step.sleep, drain_mode=mode)
    assert pod.call_log()[-1]["params"] == {"level": "1", "mode": sleeps}


async def test_keep_resets_the_prefix_cache_of_the_frozen_requests_too(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """Regression: vLLM refused the reset while the requests a keep drain froze held blocks,
    and the pass retried until it gave up (found on real vLLM under load)."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    await drain(pod, Step.resetCache, drain_mode="keep")
    assert pod.call_log()[-2]["params"] == {"reset_running_requests": "true"}
    await drain(pod, Step.resetCache, drain_mode="wait")
    assert pod.call_log()[-2]["params"] == {}


class CallTimes:
    """A WorkerClient's before_call: when each call was about to be sent (epoch seconds)."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.lost = False  # then it raises as the leader's lease check does

    def __call__(self) -> None:
        if self.lost:
            raise LeadershipLost("the lease may have expired")
        self.at.append(time.time())


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
async def test_the_pause_waits_for_the_drain_delay_since_the_pod_left_traffic(
    sim_fleet: Callable[..., list[SimPod]], mode: str
) -> None:
    """spec.sequence.drainDelaySeconds: endpoints and gateways learn that the pod left traffic
    with some lag, so the pause is sent no earlier than drainDelaySeconds after the record's
    left_traffic; the pod serves what reaches it meanwhile (nothing is called on it)."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    left = time.time() - 0.8  # the record taking the pod out of traffic, written a while ago
    calls = CallTimes()
    await drain(pod, record=replace(progress(), left_traffic=left), before_call=calls,
                drain_mode=mode, drain_delay_seconds=1)  # fmt: skip
    assert pod.calls()[0] == "pause", pod.calls()
    assert calls.at[0] >= left + 1.0
    # From left_traffic, not from the step's start (that would be left + 1.8).
    assert calls.at[0] < left + 1.6


async def test_a_pass_that_left_traffic_before_the_delay_pauses_at_once(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """Measured from the record: a pass resumed after an operator restart (or a drain tried
    again) whose pod left traffic longer ago than the delay does not wait again."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    began = time.monotonic()
    old = replace(progress(), left_traffic=time.time() - 5)
    assert await drain(pod, record=old, drain_delay_seconds=3) == ""
    assert time.monotonic() - began < 1
    assert pod.calls() == ["pause"]


async def test_a_record_from_a_clock_ahead_waits_no_longer_than_the_delay(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """left_traffic written by an operator whose clock ran ahead of this one's: the wait is
    still bounded by drainDelaySeconds."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    began = time.monotonic()
    ahead = replace(progress(), left_traffic=time.time() + 60)
    await drain(pod, record=ahead, drain_delay_seconds=1)
    assert time.monotonic() - began < 2


async def test_no_drain_delay_by_default(sim_fleet: Callable[..., list[SimPod]]) -> None:
    """drainDelaySeconds 0 (the default): the pause follows at once, as before the field."""
    assert Sequence().drain_delay_seconds == 0
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    began = time.monotonic()
    assert await drain(pod, record=progress()) == ""
    assert time.monotonic() - began < 1
    assert pod.calls() == ["pause"]


async def test_a_leader_that_lost_its_lease_during_the_delay_never_pauses(
    sim_fleet: Callable[..., list[SimPod]],
) -> None:
    """The pause after the delay is a worker call like every other: the lease check before
    it (WorkerClient before_call) stops a replica that may have lost its leadership
    meanwhile, and nothing is sent to the pod."""
    (pod,) = sim_fleet(1, admin_token=ADMIN)
    calls = CallTimes()
    # The lease is lost while the delay runs (the record left traffic just now).
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, setattr, calls, "lost", True)
    with pytest.raises(LeadershipLost):
        await drain(pod, record=progress(), before_call=calls, drain_delay_seconds=1)
    assert pod.calls() == []
