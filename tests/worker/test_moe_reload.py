"""Refits of a mixture-of-experts model on a real vLLM CPU engine (the tiny Mixtral of
testbed/tiny_moe.py: 2 layers, 4 experts, top-2, fp32).

vLLM #42821 on CPU: vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` skips the CPU
experts' prepack on a reload, so a layerwise reload copies checkpoint-layout weights into the
prepacked kernel tensors and the MoE serves garbage while the reload reports success.
refit_worker.backports.moe_reload backports the prepack; here a refit A -> B -> A through
refit_stage + refit_load scores what a fresh load of the same files scores (within 1e-4),
the same reload without the backport fails the probe, a checkpoint with one expert left at
A's weights fails the probe against B's reference, and the probe prompts reach every expert.

Two servers, one after the other (never two at once): a short-lived one started from B's
files records what a fresh load of B scores; then the module's server starts from A's files
(what a fresh load of A scores) with the test extension tests/worker/hazard_extension.py.
The allowed root is a copy of the checkpoints, so tests may add broken variants to it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from refit_operator.core.api_spec import Thresholds
from refit_operator.core.probe import evaluate
from refit_worker import checkpoint, reference
from refit_worker.contract import CAP_MOE_RELAYOUT_ON_RELOAD, ProbeReference

from testbed.tiny_moe import (
    CHECKPOINTS,
    NUM_EXPERTS,
    STALE_EXPERT,
    STALE_LAYER,
    TinyMoe,
    ensure_tiny_moe,
)
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.reload import assert_matches, rejection, scores, staged_refit, swap

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FRESH_TOL = 1e-4  # fp32 refit vs fp32 fresh load of the same files
HAZARDS = "tests.worker.hazard_extension.HazardExtension"
Scores = list[list[float | None]]


@pytest.fixture(scope="module")
def tiny_moe() -> TinyMoe:
    return ensure_tiny_moe()


@pytest.fixture(scope="module")
def root(tiny_moe: TinyMoe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe-root")
    for name in CHECKPOINTS:
        shutil.copytree(tiny_moe.checkpoints[name], root / name)
    return root


def moe_server(
    tiny_moe: TinyMoe, root: Path, name: str, extra: list[str]
) -> AbstractContextManager[VllmServer]:
    return start_vllm_server(
        tiny_moe,
        api_key="test-api-key",
        load_format="safetensors",
        model_dir=root / name,
        env={"REFIT_ALLOWED_ROOT": str(root)},
        extra_args=extra,
    )


@pytest.fixture(scope="module")
def fresh(tiny_moe: TinyMoe, root: Path, http: httpx.Client) -> dict[str, Scores]:
    """What fresh server loads of A and B score on the probe prompts (A is filled in by
    the module's server, right after it starts)."""
    with moe_server(tiny_moe, root, "B", []) as server:
        return {"B": scores(server, http, tiny_moe.reference("B"))}


@pytest.fixture(scope="module")
def server(
    tiny_moe: TinyMoe, root: Path, fresh: dict[str, Scores], http: httpx.Client
) -> Iterator[VllmServer]:
    with moe_server(tiny_moe, root, "A", ["--worker-extension-cls", HAZARDS]) as s:
        fresh["A"] = scores(s, http, tiny_moe.reference("A"))
        yield s


def max_delta(got: Scores, want: Scores) -> float:
    return max(
        abs(a - b)  # type: ignore[operator]
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g[1:], w[1:], strict=True)
    )


def worst_tokens(got: Scores, ref: ProbeReference, n: int = 5) -> list[tuple[int, int, float]]:
    """(prompt, token, |Δlogprob|) of the n tokens furthest from the reference."""
    deltas = [
        (i, j, abs(g[j] - p.logprobs[j]))  # type: ignore[operator]
        for i, (g, p) in enumerate(zip(got, ref.prompts, strict=True))
        for j in range(1, len(g))
    ]
    return sorted(deltas, key=lambda d: -d[2])[:n]


def test_refit_A_to_B_to_A_scores_like_fresh_loads(
    server: VllmServer,
    tiny_moe: TinyMoe,
    root: Path,
    fresh: dict[str, Scores],
    http: httpx.Client,
) -> None:
    assert_matches(fresh["A"], tiny_moe.reference("A"))  # a fresh load matches HF
    assert max_delta(fresh["A"], fresh["B"]) > 1  # A and B are far apart
    measured = {}
    for name in ("B", "A"):
        staged, loaded = staged_refit(server, http, root / name, name)
        # Preflight mapped every checkpoint tensor, each expert's included, to the model.
        assert staged["tensors"] == staged["parameters"] == 3 + 2 * (4 + 3 * NUM_EXPERTS + 3)
        assert loaded["source"] == "memory"
        got = scores(server, http, tiny_moe.reference(name))
        measured[name] = max_delta(got, fresh[name])
        assert measured[name] <= FRESH_TOL, (name, measured[name])
        assert_matches(got, tiny_moe.reference(name))
    print(f"\nMoE refit vs fresh load, max |Δlogprob|: {measured}")
    # Only now is the backport asked about: the refits above ran on what the plugin's import
    # hook installed when vLLM built the model's CPU experts, before any refit_info.
    info = server.rpc(http, "refit_info")
    assert CAP_MOE_RELAYOUT_ON_RELOAD in info["capabilities"]
    assert (info["unsafe_reasons"], info["kv_cache_scales"]) == ([], "")
    # vLLM 0.32 CPU lacks the fix: the capability is the backport's.
    assert server.rpc(http, "hazard_backport_states")[CAP_MOE_RELAYOUT_ON_RELOAD] == "backported"


def test_without_the_backport_the_reload_corrupts_and_the_probe_fails(
    server: VllmServer,
    tiny_moe: TinyMoe,
    root: Path,
    fresh: dict[str, Scores],
    http: httpx.Client,
) -> None:
    staged_refit(server, http, root / "A", "A")
    ref = tiny_moe.reference("B")
    try:
        server.rpc(http, "hazard_unpatch_moe_reload")
        swap(server, http, str(root / "B"), "B")  # vLLM's reload reports success
        got = scores(server, http, ref)
    finally:
        states = server.rpc(http, "hazard_backport_states")  # installs the backport again
    outcome = evaluate(ref, got, Thresholds())
    print(f"\nvLLM 0.32 CPU MoE reload without the backport: {outcome.message}; worst tokens "
          f"(prompt, token, |Δ|): {worst_tokens(got, ref)}")  # fmt: skip
    assert outcome.verdict == "Fail" and outcome.reason == "LogprobDrift"
    assert max_delta(got, fresh["B"]) > 1
    assert states[CAP_MOE_RELAYOUT_ON_RELOAD] == "backported"
    swap(server, http, str(root / "B"), "B")  # the same files again, with the backport
    assert max_delta(scores(server, http, ref), fresh["B"]) <= FRESH_TOL


def test_one_expert_left_at_old_weights_fails_the_probe(
    server: VllmServer, tiny_moe: TinyMoe, root: Path, http: httpx.Client
) -> None:
    """B except layer STALE_LAYER's expert STALE_EXPERT, taken from A (what a reload that
    skipped one expert serves), with B's reference and a valid manifest."""
    ref = tiny_moe.reference("B")
    assert (
        ProbeReference.from_json_dict(
            server.rpc(http, "refit_probe_reference", str(root / "stale_expert"))
        )
        == ref
    )  # it claims to be B
    staged_refit(server, http, root / "stale_expert", "B")
    got = scores(server, http, ref)
    outcome = evaluate(ref, got, Thresholds())
    worst = worst_tokens(got, ref)
    print(f"\nexpert {STALE_EXPERT} of layer {STALE_LAYER} at A's weights: {outcome.message}; "
          f"worst tokens (prompt, token, |Δ|): {worst}")  # fmt: skip
    assert outcome.verdict == "Fail" and outcome.reason == "LogprobDrift"
    assert worst[0][2] > Thresholds().max_abs_logprob_diff
    # The pod serves exactly what the files hold (HF on the same files): the probe fails
    # on the weights, not on numerics.
    ids = [list(p.token_ids) for p in ref.prompts]
    hf = [list(p.logprobs) for p in reference.score(root / "stale_expert", ids, "float32")]
    assert max_delta(got, hf) <= FRESH_TOL


def test_the_probe_prompts_reach_every_expert(
    server: VllmServer,
    tiny_moe: TinyMoe,
    root: Path,
    fresh: dict[str, Scores],
    http: httpx.Client,
) -> None:
    """Every expert of every layer is among the router's top-k for some probe token, so a
    stale expert anywhere moves some scored logprob."""
    staged_refit(server, http, root / "B", "B")
    ref = tiny_moe.reference("B")
    assert server.rpc(http, "hazard_count_experts") == {"layers": 2}
    assert max_delta(scores(server, http, ref), fresh["B"]) <= FRESH_TOL
    counts = server.rpc(http, "hazard_expert_counts")
    tokens = sum(len(p.token_ids) for p in ref.prompts)
    print(f"\nrouter top-2 picks per expert over {tokens} probe tokens: {counts}")
    assert len(counts) == 2
    for layer, picks in counts.items():
        assert len(picks) == NUM_EXPERTS and min(picks) > 0, (layer, picks)


@pytest.mark.parametrize("damage", ["missing", "wrong_shape"])
def test_preflight_refuses_a_damaged_expert_before_touching_the_model(
    server: VllmServer, tiny_moe: TinyMoe, root: Path, http: httpx.Client, damage: str
) -> None:
    from safetensors.torch import load_file, save_file

    staged_refit(server, http, root / "A", "A")
    before = scores(server, http, tiny_moe.reference("A"))
    target = root / f"B-{damage}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / "B", target)
    name = f"{TinyMoe.expert_prefix(0, NUM_EXPERTS - 1)}w2.weight"
    for shard in checkpoint.safetensors_files(target):
        tensors = load_file(str(shard))
        if name in tensors:
            if damage == "missing":
                del tensors[name]
            else:
                tensors[name] = tensors[name][:, :64].contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
    checkpoint.write_manifest(target)
    code, detail = rejection(server, http, "refit_stage", str(target))
    assert code == "TensorMismatch" and name in detail, detail
    assert scores(server, http, tiny_moe.reference("A")) == before
