"""The pure parts of refit_operator.tools.integrations.trl: how TRL's prompt batch is grouped, which
pods generate, which sampling settings go to vLLM, and how a completion is checked against the
version the trainer published (the fail-closed part): by the route's weight-version spans, or,
on /v1/completions, by the pod's records before and after its requests."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from refit_operator.core.podflow import PROGRESS_ANNOTATION, Progress
from refit_operator.core.podview import PodView
from refit_operator.tools.integrations.trl import (
    READY_GATE,
    RECORDS_KEPT,
    RefitRollout,
    StaleRollout,
    choice_tokens,
    group_prompts,
    parse_choice,
    ready_pod_urls,
    sampling_params,
    served_throughout,
)
from refit_operator.tools.refit_error import RefitError
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


def test_a_completions_choice_gives_its_tokens_and_logprobs() -> None:
    """/v1/completions with return_token_ids: ``token_ids`` and ``logprobs.token_logprobs``."""
    c = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"]}}
    assert choice_tokens(c) == ([5, 6], [-0.5, -1.5])
    with pytest.raises(StaleRollout, match="2 tokens but 1 logprobs"):
        choice_tokens({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5]}})


def served(name: str, version: str, *, started: float = 1.0, restarts: int = 0, ready: bool = True,
           uid: str = "u1") -> PodView:  # fmt: skip
    """A pod whose last pass brought it to ``version`` (Succeeded), as PodView reads it."""
    record = Progress(refit="r", uid="r1", version=version, path="/ckpt", outcome="Succeeded",
                      started=started, restarts=restarts)  # fmt: skip
    doc = {
        "metadata": {"name": name, "uid": uid,
                     "annotations": {PROGRESS_ANNOTATION: record.to_annotation()}},
        "spec": {"readinessGates": [{"conditionType": READINESS_GATE}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": READINESS_GATE, "status": str(ready)}],
                   "containerStatuses": [{"restartCount": restarts}]},
    }  # fmt: skip
    return PodView.from_pod(doc)


def test_a_pod_that_served_the_version_throughout_vouches_for_its_completions() -> None:
    assert served("a", "v2").serving == "v2"
    assert served_throughout(served("a", "v2"), served("a", "v2"), "v2") == ""


@pytest.mark.parametrize(
    ("before", "after", "why"),
    [
        (served("a", "v1"), served("a", "v1"), "served v1 before its requests, not v2"),
        (served("a", "v2"), served("a", "v3"), "served v3 after its requests"),
        # Out of traffic now (a refit began): no probed version to vouch.
        (served("a", "v2"), served("a", "v2", ready=False), "served no probed version after"),
        # Refit away and back to v2 in between: another pass record.
        (served("a", "v2"), served("a", "v2", started=9.0), "refit or restarted"),
        (served("a", "v2"), served("a", "v2", restarts=1), "refit or restarted|no probed"),
        (served("a", "v2"), served("a", "v2", uid="u2"), "refit or restarted"),  # replaced
        (served("a", "v2"), None, "left the fleet"),
    ],
)  # fmt: skip
def test_completions_without_spans_fail_closed_unless_the_pod_served_the_version_throughout(
    before, after, why
) -> None:
    assert re.search(why, served_throughout(before, after, "v2"))


def test_a_route_is_checked_when_the_rollout_is_made() -> None:
    common: dict[str, Any] = {"fleet_selector": "app=x", "port": 8000,
                              "probe_token_ids": [[1]], "rendezvous": ("127.0.0.1", 1)}  # fmt: skip
    with pytest.raises(ValueError, match="route 'grpc': one of generate, completions"):
        RefitRollout(SimpleNamespace(), route="grpc", **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the pods, not service_url"):
        RefitRollout(SimpleNamespace(),  # type: ignore[arg-type]
                     route="completions", service_url="http://svc", **common)  # fmt: skip


def test_a_long_run_keeps_a_bounded_record_and_an_early_selector_check() -> None:
    common: dict[str, Any] = dict(port=8000, probe_token_ids=[[1]], rendezvous=("127.0.0.1", 1))
    rollout = RefitRollout(SimpleNamespace(),  # type: ignore[arg-type]
                           fleet_selector={"app": "x", "pool": "a"}, **common)  # fmt: skip
    assert rollout.records.maxlen == RECORDS_KEPT  # memory stays flat over a long run
    assert rollout.label_selector == "app=x,pool=a"
    with pytest.raises(RefitError, match="not key=value"):
        RefitRollout(SimpleNamespace(), fleet_selector="app in (x)", **common)  # type: ignore[arg-type]
