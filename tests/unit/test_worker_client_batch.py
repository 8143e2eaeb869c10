"""WorkerClient.score_prompts against answers no well-behaved vLLM sends: the client matches
choices by index and fails with a protocol error naming the prompt and what is wrong.

The server is a loopback aiohttp web server: each test rewrites a vLLM-shaped answer (one
choice per prompt, as vLLM 0.32 answers a list of token-id prompts) before it reaches the
client, which talks to it through the operator's own session.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient, WorkerError

from tests.fixtures.loopback import serving

MODEL = "mock-model"
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
Rewrite = Callable[[list[dict[str, Any]]], list[Any]]


def logprob(prompt: int, position: int) -> float:
    """A distinct logprob for each (prompt, position): a mixed-up mapping shows."""
    return -(prompt + 1) - position / 100


def choice(index: int, ids: list[int]) -> dict[str, Any]:
    entries: list[Any] = [None] + [
        {str(t): {"logprob": logprob(index, i), "rank": 1, "decoded_token": "x"}}
        for i, t in enumerate(ids[1:], start=1)
    ]
    return {
        "index": index,
        "text": "",
        "finish_reason": "length",
        "token_ids": [1],
        "prompt_logprobs": entries,
        "prompt_token_ids": ids,
    }


def expected(index: int, ids: list[int]) -> list[float | None]:
    return [None] + [logprob(index, i) for i in range(1, len(ids))]


class Server:
    """Answers /v1/models and /v1/completions; keeps every completions body it received."""

    def __init__(self) -> None:
        self.rewrite: Rewrite = lambda choices: choices
        self.bodies: list[Any] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def completions(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.bodies.append(body)
        choices = [choice(i, ids) for i, ids in enumerate(body["prompt"])]
        return web.json_response({"choices": self.rewrite(choices), "usage": {}})


Make = Callable[[Rewrite], tuple[WorkerClient, Server]]


@pytest.fixture
async def http() -> AsyncIterator[Make]:
    """Makes a client of this test's own server, which answers through the given rewrite."""
    server = Server()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.completions)
    async with serving(app) as url, worker_client.session() as session:

        def make(rewrite: Rewrite) -> tuple[WorkerClient, Server]:
            server.rewrite = rewrite
            return WorkerClient(url, http=session, api_key="k"), server

        yield make


async def test_one_request_with_every_prompt(http: Make) -> None:
    client, server = http(lambda choices: choices)
    scored = await client.score_prompts(PROMPTS, timeout=5)
    assert scored == [expected(i, ids) for i, ids in enumerate(PROMPTS)]
    assert server.bodies == [
        {
            "model": MODEL,
            "prompt": PROMPTS,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
    ]


async def test_score_is_score_prompts_of_one_prompt(http: Make) -> None:
    client, server = http(lambda choices: choices)
    assert await client.score([4, 3, 2]) == expected(0, [4, 3, 2])
    assert server.bodies[0]["prompt"] == [[4, 3, 2]]


async def test_choices_are_matched_by_index_not_order(http: Make) -> None:
    client, _ = http(lambda choices: list(reversed(choices)))
    scored = await client.score_prompts(PROMPTS)
    assert scored == [expected(i, ids) for i, ids in enumerate(PROMPTS)]


async def test_non_finite_logprobs_are_data_not_errors(http: Make) -> None:
    def nan(choices: list[dict[str, Any]]) -> list[Any]:
        choices[1]["prompt_logprobs"][1]["9"]["logprob"] = "NaN"
        return choices

    client, _ = http(nan)
    scored = await client.score_prompts(PROMPTS)
    assert math.isnan(scored[1][1] or 0.0)
    assert scored[0] == expected(0, PROMPTS[0])


def drop(index: int) -> Rewrite:
    return lambda choices: [c for c in choices if c["index"] != index]


def edit(index: int, key: str, value: Any) -> Rewrite:
    def rewrite(choices: list[dict[str, Any]]) -> list[Any]:
        choices[index][key] = value
        return choices

    return rewrite


@pytest.mark.parametrize(
    ("rewrite", "message"),
    [
        (drop(1), "completions: no choice for prompt(s) [1] of 3"),
        (lambda choices: [], "completions: no choice for prompt(s) [0, 1, 2] of 3"),
        (edit(2, "index", 0), "completions: two choices for prompt 0"),
        (edit(2, "index", 3), "completions: a choice has index 3, the request had 3 prompts"),
        (edit(0, "index", -1), "completions: a choice has index -1, the request had 3 prompts"),
        (edit(1, "index", "1"), "completions: choice: 'index' is str, not <class 'int'>"),
        (lambda choices: [*choices, "x"], "completions: choice: answer lacks 'index': x"),
        (
            edit(2, "prompt_logprobs", [None, None, None]),
            "completions: prompt 2: 3 prompt_logprobs for 4 tokens",
        ),
        (
            edit(1, "prompt_logprobs", [None, None, None]),
            "completions: prompt 1: 3 prompt_logprobs for 2 tokens",
        ),
        (
            edit(0, "prompt_logprobs", None),
            "completions: prompt 0: 'prompt_logprobs' is NoneType, not <class 'list'>",
        ),
        (
            edit(1, "prompt_token_ids", [8, 99]),
            "completions: prompt 1: the choice scored other tokens than the prompt holds",
        ),
        (
            edit(1, "prompt_token_ids", None),
            "completions: prompt 1: 'prompt_token_ids' is NoneType, not <class 'list'>",
        ),
        (
            edit(2, "prompt_logprobs", [None, 1, None, None]),
            "completions: prompt 2: prompt_logprobs[1]: entry is int, not an object",
        ),
    ],
    ids=[
        "missing-choice",
        "no-choices",
        "duplicate-index",
        "index-too-large",
        "negative-index",
        "index-not-int",
        "choice-not-object",
        "too-few-logprobs",
        "too-many-logprobs",
        "no-prompt-logprobs",
        "other-tokens",
        "no-prompt-token-ids",
        "bad-entry",
    ],
)
async def test_a_malformed_answer_is_a_protocol_error_naming_the_prompt(
    http: Make, rewrite: Rewrite, message: str
) -> None:
    client, _ = http(rewrite)
    with pytest.raises(WorkerError) as err:
        await client.score_prompts(PROMPTS)
    assert (err.value.kind, err.value.message) == ("protocol", message)
