"""The probe of a pod whose vLLM runs a speculative drafter with weights of its own: the
verdict on the drafter's greedy acceptance (probe.judge_drafter, pure) and how the client
measures it from vLLM's own counters (WorkerClient.draft_acceptance, against a loopback
server that answers /metrics in vLLM 0.32's shape: one series per engine)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from refit_operator.core import probe
from refit_operator.core.api_spec import Thresholds
from refit_operator.core.reasons import Reason
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import DRAFT_PROBE_TOKENS, WorkerClient, WorkerError

from tests.fixtures.loopback import serving

PASSED = probe.ProbeOutcome("Pass", Reason.ProbePassed, "within thresholds", nll=2.0, tokens=9)
MIN = Thresholds().min_draft_acceptance


def test_a_drafter_that_drafts_as_the_target_decodes_passes_and_is_recorded() -> None:
    judged = probe.judge_drafter(PASSED, drafted=64, accepted=64, minimum=MIN)
    assert judged.verdict == "Pass" and judged.draft_acceptance == 1.0
    assert judged.to_status().draft_acceptance == 1.0
    assert PASSED.to_status().draft_acceptance is None  # a pod without a drafter


def test_a_stale_drafter_fails_though_the_target_passed() -> None:
    # 0.32: the tiny model's target B with A's weights drafting (tests/worker/test_drafter.py).
    judged = probe.judge_drafter(PASSED, drafted=100, accepted=32, minimum=MIN)
    assert (judged.verdict, judged.reason) == ("Fail", Reason.DraftAcceptanceLow)
    assert "0.320 of 100 drafted tokens" in judged.message and judged.draft_acceptance == 0.32
    assert judged.nll == PASSED.nll  # the target's numbers stay in the record


def test_no_drafts_is_inconclusive_and_zero_turns_the_check_off() -> None:
    judged = probe.judge_drafter(PASSED, drafted=0, accepted=0, minimum=MIN)
    assert (judged.verdict, judged.reason) == ("Inconclusive", Reason.DraftNoData)
    assert probe.judge_drafter(PASSED, drafted=100, accepted=1, minimum=0.0) == PASSED
    failed = probe.ProbeOutcome("Fail", Reason.LogprobDrift, "target drifted")
    assert probe.judge_drafter(failed, drafted=100, accepted=1, minimum=MIN) == failed


class Engine:
    """vLLM's spec-decode counters on /metrics, moved by each completion."""

    def __init__(self, per_request: tuple[float, float] = (8.0, 6.0)) -> None:
        self.per_request = per_request
        self.counts = [[10.0, 4.0], [3.0, 1.0]]  # two engines: each its own series
        self.bodies: list[dict[str, Any]] = []
        self.metrics = True

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def completions(self, request: web.Request) -> web.Response:
        self.bodies.append(json.loads(await request.read()))
        self.counts[0][0] += self.per_request[0]
        self.counts[0][1] += self.per_request[1]
        return web.json_response({"choices": [], "usage": {}})

    async def metrics_text(self, request: web.Request) -> web.Response:
        lines = ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{e="0"} 0']
        if self.metrics:
            for name, i in (("draft", 0), ("accepted", 1)):
                lines.append(f"# TYPE vllm:spec_decode_num_{name}_tokens counter")
                for engine, counts in enumerate(self.counts):
                    lines.append(f'vllm:spec_decode_num_{name}_tokens_total{{engine="{engine}"}} '
                                 f"{counts[i]}")  # fmt: skip
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


@pytest.fixture
async def served() -> AsyncIterator[tuple[WorkerClient, Engine]]:
    engine = Engine()
    app = web.Application()
    app.router.add_get("/v1/models", engine.models)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_get("/metrics", engine.metrics_text)
    async with serving(app) as url, worker_client.session() as session:
        yield WorkerClient(url, http=session), engine


async def test_acceptance_is_measured_by_the_counters_moved_by_greedy_decoding(
    served: tuple[WorkerClient, Engine],
) -> None:
    client, engine = served
    prompts = [[1, 2, 3], [4, 5]]
    assert await client.draft_acceptance(prompts, timeout=5) == (8.0, 6.0)  # one request
    assert engine.bodies == [{"model": "m", "prompt": prompts, "max_tokens": DRAFT_PROBE_TOKENS,
                              "temperature": 0, "ignore_eos": True}]  # fmt: skip
    # A pod that runs LoRA: one request per prompt (a batch kills that CPU engine).
    assert await client.draft_acceptance(prompts, timeout=5, batch=False) == (16.0, 12.0)
    assert [b["prompt"] for b in engine.bodies[1:]] == [[p] for p in prompts]


async def test_counters_missing_or_going_wrong_are_protocol_errors(
    served: tuple[WorkerClient, Engine],
) -> None:
    client, engine = served
    engine.per_request = (2.0, 5.0)  # more accepted than drafted: not vLLM's counters
    with pytest.raises(WorkerError) as bad:
        await client.draft_acceptance([[1, 2]], timeout=5)
    assert bad.value.kind == "protocol"
    engine.metrics = False  # a pod without speculative decoding exports none
    with pytest.raises(WorkerError, match="missing vllm:spec_decode_num_draft_tokens_total"):
        await client.draft_acceptance([[1, 2]], timeout=5)
