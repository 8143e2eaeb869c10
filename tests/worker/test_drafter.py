"""A speculative drafter with weights of its own, on real vLLM CPU: what the build runs, why
the operator refuses to refit it (UnsafeConfiguration, vLLM #52487), and the signal that
tells a stale drafter from a fresh one.

vLLM 0.32's CPU build runs `--speculative-config {"method": "draft_model", ...}` with the tiny
model as its own drafter (the CPU model runner loads it beside the target; EAGLE and MTP need
heads the test bed does not build). Its drafts are greedy, so with greedy decoding a drafter
holding the target's weights has every drafted token accepted, and one holding other weights
far fewer (measured 126/126 = 1.0 for A drafting for A, 74/230 = 0.32 for B drafting for A);
under sampling even a fresh drafter's drafts are accepted at the target's probability of them
(0.23 for A and A), which says nothing about staleness. The counts are vLLM's own
(vllm:spec_decode_num_{draft,accepted}_tokens_total on /metrics).

A refit of the target alone (the worker's refit_load, as the operator's load step sends it)
leaves the drafter on the old weights: the target serves the new version, and the greedy
acceptance falls. That is what UnsafeConfiguration guards against until drafters are refitted
with their target (docs/concepts.md, "Reload hazards beyond attention scales").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from refit_operator.core import admission
from refit_operator.core.reasons import Reason
from refit_worker.contract import RefitInfo

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.reload import admin, assert_matches, refit_cycle, scores

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPECULATIVE_TOKENS = 2
FRESH = 0.99  # greedy acceptance of a drafter holding the target's weights: all of them
STALE = 0.6  # ... and at most this for one left on other weights (measured 0.32)


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    a = str(tiny_model.checkpoints["A"])
    drafter = {"method": "draft_model", "model": a, "num_speculative_tokens": SPECULATIVE_TOKENS}
    with start_vllm_server(
        tiny_model,
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        extra_args=["--speculative-config", json.dumps(drafter)],
    ) as server:
        yield server


def spec_counts(server: VllmServer, http: httpx.Client) -> tuple[float, float]:
    """vLLM's drafted and accepted token counts so far."""
    text = http.get(server.base_url + "/metrics").text

    def total(name: str) -> float:
        found = re.search(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert found is not None, f"no vllm:{name}_total on /metrics"
        return float(found.group(1))

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def greedy_acceptance(server: VllmServer, http: httpx.Client, tiny_model: TinyModel) -> float:
    """The share of drafted tokens the target accepted while it decoded the probe prompts
    greedily (the pod is idle: nothing else moves the counts)."""
    prompts = [list(p.token_ids) for p in tiny_model.reference("A").prompts]
    drafted, accepted = spec_counts(server, http)
    body = {"model": server.model, "prompt": prompts, "max_tokens": 48, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    r = http.post(server.base_url + "/v1/completions", json=body, headers=server.api_headers())
    assert r.status_code == 200, r.text[:300]
    drafted_now, accepted_now = spec_counts(server, http)
    assert drafted_now - drafted > 0, "the drafter drafted nothing: no speculative decoding"
    return (accepted_now - accepted) / (drafted_now - drafted)


def test_the_drafter_runs_and_the_operator_refuses_to_refit_it(
    vllm_server: VllmServer, http: httpx.Client
) -> None:
    body = {"method": "refit_info"}
    answer = admin(vllm_server, http, "POST", "/collective_rpc", json=body)["results"][0]
    info = RefitInfo.from_json_dict(answer)
    assert any("draft_model" in r and "#52487" in r for r in info.unsafe_reasons), info
    problem = admission.admission_problem(info, allow_unsafe=False, sleep_level=1)
    assert problem is not None and problem.reason == Reason.UnsafeConfiguration
    assert "drafter" in problem.message


def test_a_refit_of_the_target_alone_leaves_the_drafter_stale(
    vllm_server: VllmServer, http: httpx.Client, tiny_model: TinyModel
) -> None:
    fresh = greedy_acceptance(vllm_server, http, tiny_model)
    assert fresh >= FRESH, f"drafter A for target A: greedy acceptance {fresh:.3f}"
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["B"]), "B")
    reference = tiny_model.reference("B")
    assert_matches(scores(vllm_server, http, reference), reference)  # the target serves B
    stale = greedy_acceptance(vllm_server, http, tiny_model)
    print(f"\ngreedy acceptance: drafter on the target's weights {fresh:.3f}, stale {stale:.3f}")
    assert stale <= STALE, f"drafter A for target B: greedy acceptance {stale:.3f}"
