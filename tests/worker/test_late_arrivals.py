"""A request that reaches a pod after its drain began, on a real vLLM CPU engine: the drain
ends with the pause (it never waits for such a request), and the request is aborted with
vLLM's clean, retryable abort before the scheduler resumes, so it never runs on weights no
probe has passed: by the sleep step's abort when it arrived before the sleep, else by the
abort the wakeKV step sends before its wake (which resumes vLLM).

It happens whenever a gateway routes to the pod in the moment between its readiness going
False and the endpoints dropping it. vLLM queues it (paused engines take no new work), and
the counts in /metrics, published by the last engine step, keep it as waiting: the drain
waited for it until drainTimeoutSeconds (bench under_load measured a 60.4 s drain). With
the drain ``abort`` the request here arrives after the sleep (the drain is immediate), so
only the wakeKV abort catches it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from refit_operator.controller import steps
from refit_operator.core import podflow
from refit_operator.core.api import Sequence
from refit_operator.core.podflow import Step
from refit_operator.edges.worker_client import WorkerClient, session

from testbed.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

BUSY = 4  # requests running when the drain begins
BUSY_TOKENS = 400  # long enough that the drain's wait spans the late request's arrival


async def drain_with_a_late_arrival(server: VllmServer, mode: str) -> dict[str, Any]:
    seq = Sequence.model_validate({"drain_mode": mode, "drain_timeout_seconds": 20})
    progress = podflow.start("wr", "u1", "B", "/c/B", now=time.time())
    async with (
        session() as http,
        httpx.AsyncClient(base_url=server.base_url, headers=server.api_headers(),
                          timeout=60) as client,
    ):  # fmt: skip
        worker = WorkerClient(server.base_url, http=http, admin_token=server.admin_token)

        async def complete(tokens: int) -> str:
            body = {"model": server.model, "prompt": "hello", "max_tokens": tokens,
                    "ignore_eos": True}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return str(r.json()["choices"][0]["finish_reason"])

        async def step(s: Step) -> None:
            await steps.execute_step(worker, seq, progress, s, False)

        busy = [asyncio.create_task(complete(BUSY_TOKENS)) for _ in range(BUSY)]
        await asyncio.sleep(0.3)  # scheduled and running
        began = time.monotonic()
        drain = asyncio.create_task(step(Step.drain))
        await asyncio.sleep(0.1)  # the pause has begun
        late = asyncio.create_task(complete(20))
        await drain
        drained = time.monotonic() - began
        await step(Step.sleep)
        await step(Step.wakeWeights)
        await step(Step.wakeKV)  # aborts what is queued, then wakes: vLLM resumes here
        late_reason = await asyncio.wait_for(late, 30)
        busy_reasons = await asyncio.gather(*busy)
        after = await complete(5)
    return {"drained": drained, "late": late_reason, "busy": busy_reasons, "after": after}


# wait: every busy request finishes on the old weights; abort: those still running are cut
# (the tiny model may finish some first).
@pytest.mark.parametrize(("mode", "busy"), [("wait", {"length"}), ("abort", {"abort", "length"})])
def test_a_request_reaching_a_draining_pod_is_aborted_never_waited_for(
    vllm_server: VllmServer, mode: str, busy: set[str]
) -> None:
    got = asyncio.run(drain_with_a_late_arrival(vllm_server, mode))
    # The drain ended with the pause: far below drainTimeoutSeconds (20 s), which it used to
    # reach (DrainTimeout) waiting for the late request.
    assert got["drained"] < 10, got
    assert set(got["busy"]) <= busy, got
    assert got["late"] == "abort", got  # aborted, never run on the weights the refit loaded
    assert got["after"] == "length", got  # the pod serves again after the wake
