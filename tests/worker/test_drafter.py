"""A speculative drafter with weights of its own, refitted with its target, on real vLLM CPU.

vLLM 0.32's CPU build runs `--speculative-config {"method": "draft_model", ...}` with the tiny
model as its own drafter (the CPU model runner loads it beside the target; EAGLE and MTP need
heads the test bed does not build). vLLM's reload loads the target only (#52487); the worker
loads the drafter from the checkpoint's drafter/ (contract.DRAFTER_DIR) right after it, or
refuses the checkpoint before touching either model (refit_worker.drafter).

A broadcast (the refit-gloo engine, this test process as the trainer) refits the drafter the
same way from the drafter's tensors sent in the target's transfer (contract.DRAFTER_PREFIX),
and a broadcast of the target alone is refused before either model is touched.

The signal: the drafter's drafts are greedy, so under greedy decoding a drafter holding the
target's weights has every drafted token accepted, and one on other weights far fewer
(measured 1.000 for A drafting for A; 0.461 after a refit of the target alone A -> B, before
the worker refitted drafters; 0.32 for B drafting for A). Under sampling even a fresh
drafter's drafts are accepted at only the target's probability of them (0.23), which says
nothing about staleness. The counts are vLLM's own
(vllm:spec_decode_num_{draft,accepted}_tokens_total on /metrics); the probe's prompt logprobs
come from the target alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from refit_operator.core import admission
from refit_worker import broadcast
from refit_worker.contract import DRAFTER_DIR, TRANSFER_BACKEND, RefitInfo, parse_rejection

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.broadcast import connect, refit_by_broadcast, send_round
from tests.fixtures.reload import (
    admin,
    assert_matches,
    checkpoint_with,
    refit_cycle,
    rejection,
    scores,
    staged_refit,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPECULATIVE_TOKENS = 2
FRESH = 0.99  # greedy acceptance of a drafter holding the target's weights: all of them
STALE = 0.6  # ... and at most this for one holding other weights (measured 0.32 to 0.46)


@pytest.fixture(scope="module")
def root(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's allowed root: A and B each with their own weights as drafter/, B without
    drafter/, B whose drafter/ has a byte the manifest does not have, and B with A's
    weights as drafter/."""
    root = tmp_path_factory.mktemp("drafter-root")
    a, b = tiny_model.checkpoints["A"], tiny_model.checkpoints["B"]
    checkpoint_with(root, "A", a, a)
    checkpoint_with(root, "B", b, b)
    checkpoint_with(root, "B-no-drafter", b, None)
    checkpoint_with(root, "B-bad-drafter", b, tiny_model.checkpoints["manifest_mismatch"])
    checkpoint_with(root, "B-drafter-A", b, a)
    return root


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel, root: Path) -> Iterator[VllmServer]:
    a = str(tiny_model.checkpoints["A"])
    drafter = {"method": "draft_model", "model": a, "num_speculative_tokens": SPECULATIVE_TOKENS}
    with start_vllm_server(
        tiny_model,
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        extra_args=[
            "--speculative-config",
            json.dumps(drafter),
            "--weight-transfer-config",  # for the broadcast test: refit-gloo
            json.dumps({"backend": TRANSFER_BACKEND}),
        ],
        env={"REFIT_ALLOWED_ROOT": str(root)},
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


def assert_serves(
    server: VllmServer, http: httpx.Client, tiny_model: TinyModel, name: str
) -> float:
    """The target scores `name`'s reference and the drafter drafts as the target would;
    returns the greedy acceptance."""
    reference = tiny_model.reference(name)
    assert_matches(scores(server, http, reference), reference)
    acceptance = greedy_acceptance(server, http, tiny_model)
    assert acceptance >= FRESH, f"target {name}: greedy acceptance {acceptance:.3f}"
    return acceptance


def test_the_worker_reports_the_drafter_it_refits(
    vllm_server: VllmServer, http: httpx.Client
) -> None:
    body = {"method": "refit_info"}
    answer = admin(vllm_server, http, "POST", "/collective_rpc", json=body)["results"][0]
    info = RefitInfo.from_json_dict(answer)
    assert info.drafter == "draft_model", info
    assert not info.unsafe_reasons, info.unsafe_reasons
    assert admission.admission_problem(info, allow_unsafe=False, sleep_level=1) is None


@pytest.mark.parametrize(
    ("name", "code", "fragment"),
    [
        ("B-no-drafter", "DrafterMissing", DRAFTER_DIR),
        ("B-bad-drafter", "ManifestMismatch", "differs from the manifest"),
    ],
)
@pytest.mark.parametrize("method", ["refit_preflight", "refit_stage", "refit_load"])
def test_a_checkpoint_without_a_good_drafter_is_refused_and_a_serves_on(
    vllm_server: VllmServer,
    http: httpx.Client,
    tiny_model: TinyModel,
    root: Path,
    name: str,
    code: str,
    fragment: str,
    method: str,
) -> None:
    args = [str(root / name)] + (["B"] if method == "refit_load" else [])
    got, detail = rejection(vllm_server, http, method, *args)
    assert (got, fragment in detail) == (code, True), detail
    # Neither model was touched: the target scores A and the drafter still drafts A.
    assert_serves(vllm_server, http, tiny_model, "A")


def test_a_refit_loads_the_drafter_with_its_target(
    vllm_server: VllmServer, http: httpx.Client, tiny_model: TinyModel, root: Path
) -> None:
    before = assert_serves(vllm_server, http, tiny_model, "A")
    # Staged (both held in memory), then unstaged (both read from disk) back to A.
    staged, loaded = staged_refit(vllm_server, http, root / "B", "B")
    assert staged["drafter"]["staged"] == "memory", staged
    assert staged["drafter"]["path"] == str((root / "B" / DRAFTER_DIR).resolve())
    assert loaded["drafter"]["source"] == "memory", loaded
    to_b = assert_serves(vllm_server, http, tiny_model, "B")
    loaded = refit_cycle(vllm_server, http, str(root / "A"), "A")
    assert loaded["drafter"]["source"] == "unstaged", loaded
    back = assert_serves(vllm_server, http, tiny_model, "A")
    print(f"\ngreedy acceptance: A {before:.3f}, refitted to B {to_b:.3f}, back to A {back:.3f}")


def test_the_drafter_is_loaded_from_drafter_not_from_the_target(
    vllm_server: VllmServer, http: httpx.Client, tiny_model: TinyModel, root: Path
) -> None:
    """The control: B with A's weights in drafter/ serves B and drafts A's tokens, so the
    acceptance above comes from drafter/ (and the signal tells a drafter on other weights)."""
    refit_cycle(vllm_server, http, str(root / "B-drafter-A"), "B")
    reference = tiny_model.reference("B")
    assert_matches(scores(vllm_server, http, reference), reference)
    other = greedy_acceptance(vllm_server, http, tiny_model)
    print(f"\ngreedy acceptance: target B, drafter A {other:.3f}")
    assert other <= STALE, f"target B, drafter A: greedy acceptance {other:.3f}"
    refit_cycle(vllm_server, http, str(root / "A"), "A")
    assert_serves(vllm_server, http, tiny_model, "A")


def test_a_broadcast_refits_the_drafter_with_its_target(
    vllm_server: VllmServer, http: httpx.Client, tiny_model: TinyModel, root: Path
) -> None:
    """B's target and B's drafter in one transfer serve B with a fresh drafter; B's target
    with A's drafter tensors serves B beside a drafter on A (the probe's DraftAcceptanceLow
    case), so the acceptance comes from the drafter tensors sent; B's target alone is
    refused DrafterMissing before either model is touched."""
    a, b = (broadcast.load_tensors(tiny_model.checkpoints[n]) for n in ("A", "B"))
    sender = connect(vllm_server)
    try:
        before = assert_serves(vllm_server, http, tiny_model, "A")
        answer, _ = send_round(vllm_server, sender, broadcast.build_manifest(b).to_json_dict(), b)
        assert answer.status_code == 500
        refusal = parse_rejection(answer.text)
        assert refusal is not None and refusal.code == "DrafterMissing", answer.text[:300]
        assert_serves(vllm_server, http, tiny_model, "A")  # neither model touched
        received = refit_by_broadcast(vllm_server, http, sender, broadcast.with_drafter(b, b), "B")
        assert received["tensors"] == 2 * len(b)
        to_b = assert_serves(vllm_server, http, tiny_model, "B")
        refit_by_broadcast(vllm_server, http, sender, broadcast.with_drafter(b, a), "B-drafter-A")
        reference = tiny_model.reference("B")
        assert_matches(scores(vllm_server, http, reference), reference)
        other = greedy_acceptance(vllm_server, http, tiny_model)
    finally:
        sender.close()
        refit_cycle(vllm_server, http, str(root / "A"), "A")
    print(
        f"\nbroadcast, greedy acceptance: A {before:.3f}, target and drafter B {to_b:.3f}, "
        f"target B with drafter A {other:.3f}"
    )
    assert other <= STALE, f"target B, drafter A by broadcast: greedy acceptance {other:.3f}"
    assert_serves(vllm_server, http, tiny_model, "A")
