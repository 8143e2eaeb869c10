"""The pure parts of refit_operator.integrations.trl: how TRL's prompt batch is grouped, which
pods generate, which sampling settings go to vLLM, and how a completion is checked against the
version the trainer published (the fail-closed part)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from refit_operator.integrations.trl import (
    READY_GATE,
    StaleRollout,
    group_prompts,
    parse_choice,
    ready_pod_urls,
    sampling_params,
)
from refit_worker.contract import READINESS_GATE


def test_the_gate_name_is_the_contracts() -> None:
    assert READY_GATE == READINESS_GATE


def test_prompts_repeated_num_generations_times_make_one_request_each() -> None:
    assert group_prompts(["a", "a", "b", "b", "a", "a"]) == [(0, 2), (2, 2), (4, 2)]
    assert group_prompts([]) == []


def pod(name: str, ip: str | None, **conds: str) -> dict:
    conditions = [{"type": {"gate": READY_GATE}.get(k, k), "status": v} for k, v in conds.items()]
    return {"metadata": {"name": name}, "status": {"podIP": ip, "conditions": conditions}}


def test_only_pods_in_traffic_generate() -> None:
    pods = [
        pod("b", "10.0.0.2", gate="True"),
        pod("a", "10.0.0.1", gate="True", Ready="True"),
        pod("c", "10.0.0.3", gate="False"),  # being refit or failed its probe
        pod("d", "10.0.0.4", gate="True", Ready="False"),  # the kubelet says not ready
        pod("e", None, gate="True"),
    ]
    assert ready_pod_urls(pods, 8000) == [
        ("a", "http://10.0.0.1:8000"),
        ("b", "http://10.0.0.2:8000"),
    ]


def test_sampling_settings_are_trls() -> None:
    trainer = SimpleNamespace(
        temperature=0.7, max_completion_length=12, top_p=0.9, top_k=None, min_p=None,
        repetition_penalty=1.0, args=SimpleNamespace(generation_kwargs={"seed": 3}),
    )  # fmt: skip
    assert sampling_params(trainer, 4) == {
        "n": 4, "temperature": 0.7, "max_tokens": 12, "logprobs": 0, "top_p": 0.9,
        "repetition_penalty": 1.0, "seed": 3,
    }  # fmt: skip


def choice(spans: list[dict] | None, ids: list[int], lps: list[float]) -> dict:
    return {
        "token_ids": ids,
        "weight_versions": spans,
        "logprobs": {
            "content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
        },
    }


def test_a_completion_at_the_published_version_is_taken() -> None:
    c = choice([{"version": "v2", "start": 0, "end": 2}], [5, 6], [-0.5, -1.5])
    assert parse_choice(c, "v2") == ([5, 6], [-0.5, -1.5])


@pytest.mark.parametrize(
    ("spans", "why"),
    [
        ([{"version": "v1", "start": 0, "end": 2}], r"\['v1'\], expected v2"),  # stale
        ([{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 2}],
         r"\['v1', 'v2'\]"),  # mixed: the weights changed mid-completion
        ([{"version": "v2", "start": 0, "end": 1}], "expected v2"),  # not every token covered
        (None, "no weight-version spans"),
    ],
)  # fmt: skip
def test_stale_mixed_or_unlabelled_completions_fail_closed(spans, why) -> None:
    with pytest.raises(StaleRollout, match=why):
        parse_choice(choice(spans, [5, 6], [-0.5, -1.5]), "v2")
