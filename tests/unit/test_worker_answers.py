"""edges/worker_answers.py: a pod's answers read as plain data, no server (test_worker_client.py
drives the same reads through HTTP against the simulated worker)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from refit_operator.edges import worker_answers as answers
from refit_operator.edges.worker_answers import WorkerError
from refit_worker import contract


def _protocol(call: Any, *args: Any) -> str:
    with pytest.raises(WorkerError) as info:
        call(*args)
    assert info.value.kind == "protocol"
    return info.value.message


def test_a_field_of_the_wrong_type_is_a_protocol_error_and_a_bool_is_no_int() -> None:
    assert answers.field({"n": 3}, "n", int, "w") == 3
    assert "lacks 'n'" in _protocol(answers.field, {}, "n", int, "w")
    assert "'n' is bool" in _protocol(answers.field, {"n": True}, "n", int, "w")
    assert "expected 'paused'" in _protocol(answers.expect, {"s": "x"}, "s", "paused", "pause")


def test_choices_are_matched_by_index_not_order() -> None:
    prompts = [[1, 2], [3, 4]]

    def choice(index: int, tokens: list[int], logprob: float) -> dict[str, Any]:
        entries = [None, {str(tokens[1]): {"logprob": logprob}}]
        return {"index": index, "prompt_token_ids": tokens, "prompt_logprobs": entries}

    doc = {"choices": [choice(1, [3, 4], -0.5), choice(0, [1, 2], -0.25)]}
    assert answers.prompt_scores(doc, prompts) == [[None, -0.25], [None, -0.5]]
    one = {"choices": [choice(0, [1, 2], -0.25)]}
    assert "no choice for prompt(s) [1]" in _protocol(answers.prompt_scores, one, prompts)
    twice = {"choices": [choice(0, [1, 2], -0.25), choice(0, [1, 2], -0.25)]}
    assert "two choices for prompt 0" in _protocol(answers.prompt_scores, twice, prompts)


def test_metric_sums_add_every_engine_and_a_missing_name_is_a_protocol_error() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2.0\n'
        'vllm:num_requests_running{engine="1"} 1.0\n'
        'vllm:num_requests_waiting{engine="0"} 4.0\n'
    )
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    assert answers.metric_sums(text, names) == [3.0, 4.0]
    assert answers.in_flight([3.0, 4.0]) == 7
    missing = _protocol(answers.metric_sums, text, ("vllm:other",))
    assert "missing vllm:other" in missing


def test_a_stale_fence_is_a_refusal_on_any_path_and_a_rejection_only_from_an_rpc() -> None:
    stale = json.dumps({"error": {"code": contract.STALE_FENCE, "message": "fence 3 < 5"}})
    error = answers.refusal(409, stale, rpc=False)
    assert error is not None
    assert (error.kind, error.code, error.message) == (
        "rejected",
        contract.STALE_FENCE,
        "fence 3 < 5",
    )
    wrapped = json.dumps({"error": {"message": (
        "Call to collective_rpc method failed: Worker failed with error 'refit-rejected: "
        "PathNotAllowed: /etc is outside', please check the stack trace above for the root cause"
    )}})  # fmt: skip
    error = answers.refusal(500, wrapped, rpc=True)
    assert error is not None
    assert (error.kind, error.code, error.message) == (
        "rejected",
        "PathNotAllowed",
        "/etc is outside",
    )
    assert answers.refusal(500, wrapped, rpc=False) is None  # an http error for the caller
    assert answers.refusal(409, "{}", rpc=True) is None
