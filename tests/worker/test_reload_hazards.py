"""What the probe sees of the reload hazards a pod cannot detect in itself, on a real vLLM
CPU engine (the tiny Llama, an fp8 KV cache, prefix caching on, the test extension
tests/worker/hazard_extension.py to inject each corruption). docs/concepts.md has the table.

vLLM's CPU attention runs an fp8 KV cache only on x86 with AVX-512 or AMX. On a CPU with
neither, the engine here runs an unquantized cache: the prefix and sink hazards are tested
on it, the three that live in fp8 scales are not (they say so as skips), and
``test_without_avx512_or_amx_an_fp8_kv_cache_is_refused_at_start`` checks the refusal itself.

- Stale prefix cache (vLLM #49789): a reload leaves the cached blocks; a request that hits
  them is served the old weights' KV. The probe cannot see it: vLLM never reads the prefix
  cache for a request with ``prompt_logprobs`` (sampling_params.py, skip_reading_prefix_cache).
  vLLM 0.32 clears the cache on /pause and on sleep, and the pod's sequence resets it after
  every load at every sleep level, so no request the pod serves meets a stale prefix.
- Wrong KV cache scales: the CPU attention quantizes the fp8 KV cache with the layer's
  host scales. Positive but wrong ones (a wake that resets calibrated scales) serve drifted
  logprobs: the probe fails. Zeroed ones (#57163's end state) stop the CPU engine at the
  first request ("k_scale must be positive for FP8 path"): the probe gets no data.
- Attention sinks that are not the checkpoint's (#57795's end state): the tiny Llama has no
  sinks; giving its real CPU attention sink logits (the kernel's ``s_aux``) moves the probe
  past the default thresholds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from refit_operator.core.api_spec import Thresholds
from refit_operator.core.probe import evaluate

from testbed.tiny_model import TinyModel
from testbed.vllm_server import (
    SERVED_MODEL,
    VllmServer,
    cpu_runs_fp8_kv_cache,
    start_vllm_server,
)
from tests.fixtures.reload import admin, refit_cycle, scores

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HAZARDS = "tests.worker.hazard_extension.HazardExtension"
BLOCK = 32  # the CPU attention's smallest block; prefix caching caches whole blocks
SINK = 8.0  # per-head sink logit given to a model that has none (0 and 4 pass: see docs)
FP8_KV = cpu_runs_fp8_kv_cache()
KV_CACHE_DTYPE = "fp8" if FP8_KV else "auto"
needs_fp8_kv = pytest.mark.skipif(
    not FP8_KV,
    reason="vLLM's CPU attention runs an fp8 KV cache only on x86 with AVX-512 or AMX, and "
    "this CPU has neither (the refusal is tested instead)",
)


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    extra = ["--kv-cache-dtype", KV_CACHE_DTYPE, "--block-size", str(BLOCK)]
    extra += ["--enable-prompt-tokens-details", "--worker-extension-cls", HAZARDS]
    with start_vllm_server(tiny_model, api_key="test-api-key", extra_args=extra) as server:
        yield server


def probe(server: VllmServer, http: httpx.Client, tiny_model: TinyModel, name: str) -> Any:
    ref = tiny_model.reference(name)
    return evaluate(ref, scores(server, http, ref), Thresholds())


def generate(server: VllmServer, http: httpx.Client, ids: list[int]) -> tuple[list[float], int]:
    """One greedy token after ``ids``: the top-5 logprobs of that token's position (sorted)
    and how many prompt tokens the prefix cache served."""
    r = http.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": SERVED_MODEL,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 5,
        },
        headers=server.api_headers(),
    )
    r.raise_for_status()
    body = r.json()
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    return sorted(top.values(), reverse=True), body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def test_the_kv_cache_passes_the_probe(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    """The baseline the injections below start from (fp8 where the CPU runs it)."""
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    outcome = probe(vllm_server, http, tiny_model, "A")
    print(f"\n{KV_CACHE_DTYPE} KV cache vs the fp32 HF reference: {outcome.message}")
    assert outcome.verdict == "Pass", outcome.message


@pytest.mark.skipif(FP8_KV, reason="this CPU runs an fp8 KV cache: the module's engine uses it")
def test_without_avx512_or_amx_an_fp8_kv_cache_is_refused_at_start(
    tiny_model: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the fp8 scale hazards are not tested on this machine: vLLM refuses the cache
    before serving anything, with a message that names the missing instructions."""
    monkeypatch.setenv("REFIT_VLLM_LOG_DIR", str(tmp_path))
    extra = ["--kv-cache-dtype", "fp8", "--block-size", str(BLOCK)]
    with pytest.raises(RuntimeError, match="before /health answered"):
        with start_vllm_server(tiny_model, extra_args=extra, progress=None):
            pass
    (log,) = tmp_path.glob("vllm-*.log")
    assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in log.read_text()


def cached_prefix(server: VllmServer, http: httpx.Client, ids: list[int]) -> list[float]:
    """Serve ``ids`` twice: the second request is served from the prefix cache."""
    generate(server, http, ids)
    logprobs, cached = generate(server, http, ids)
    assert cached == BLOCK
    return logprobs


def test_a_reload_keeps_the_prefix_cache_and_the_probe_cannot_see_it(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    """vLLM #49789: reload_weights resets LoRA, encoder and multimodal caches, not the
    prefix cache (gpu_model_runner.py reload_weights)."""
    ckpts = tiny_model.checkpoints
    ids = [t for p in tiny_model.reference("A").prompts for t in p.token_ids][: BLOCK + 8]
    refit_cycle(vllm_server, http, str(ckpts["A"]), "A")
    on_a = cached_prefix(vllm_server, http, ids)
    vllm_server.rpc(http, "refit_load", str(ckpts["B"]), "B")  # the reload alone
    stale, cached = generate(vllm_server, http, ids)
    assert cached == BLOCK  # A's KV serves a request to B
    blind = probe(vllm_server, http, tiny_model, "B")
    assert blind.verdict == "Pass", blind.message  # prompt_logprobs never read the cache
    admin(vllm_server, http, "POST", "/reset_prefix_cache")
    fresh, cached = generate(vllm_server, http, ids)
    assert cached == 0
    # Served from a prefix cache of B's own KV, the same request scores what it scored
    # computed in full: any difference from the stale answer is A's KV.
    again = cached_prefix(vllm_server, http, ids)
    floor = max(abs(a - b) for a, b in zip(again, fresh, strict=True))
    off = max(abs(a - b) for a, b in zip(stale, fresh, strict=True))
    print(f"\nprefix cache after a bare reload: the next token's top-5 logprobs are off by "
          f"{off:.4f} (from the cache of B's own KV: {floor:.1e}; A {on_a[:2]}, stale "
          f"{stale[:2]}, B {fresh[:2]})\nprobe on it: {blind.message}")  # fmt: skip
    assert floor < 1e-4 and off > 100 * max(floor, 1e-5)


@pytest.mark.parametrize("step", ["pause", "sleep", "sequence"])
def test_the_sequence_never_serves_a_stale_prefix(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, step: str
) -> None:
    """vLLM 0.32 clears the prefix cache on /pause (clear_cache defaults to true, deprecated)
    and on a sleep of level >= 1; the sequence resets it after the load anyway, which is
    what holds at level 0 (no sleep) and whatever vLLM's defaults become."""
    ckpts = tiny_model.checkpoints
    ids = [t for p in tiny_model.reference("A").prompts for t in p.token_ids][: BLOCK + 8]
    refit_cycle(vllm_server, http, str(ckpts["A"]), "A")
    cached_prefix(vllm_server, http, ids)
    if step == "pause":
        admin(vllm_server, http, "POST", "/pause", params={"mode": "wait"})
        admin(vllm_server, http, "POST", "/resume")
    elif step == "sleep":
        admin(vllm_server, http, "POST", "/sleep", params={"level": 1})
        admin(vllm_server, http, "POST", "/wake_up")
    else:
        refit_cycle(vllm_server, http, str(ckpts["B"]), "B")
    assert generate(vllm_server, http, ids)[1] == 0


@needs_fp8_kv
@pytest.mark.parametrize("scale", [0.001, 1000.0])
def test_wrong_kv_cache_scales_fail_the_probe(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, scale: float
) -> None:
    """Scales that are positive but not the ones the cache was meant for (a wake that
    resets calibrated scales, #48310): the fp8 cache clips or flushes K and V silently."""
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    try:
        assert vllm_server.rpc(http, "hazard_set_kv_scales", scale) == {"layers": 2}
        outcome = probe(vllm_server, http, tiny_model, "A")
    finally:
        vllm_server.rpc(http, "hazard_set_kv_scales", 1.0)
    print(f"\nKV cache scales {scale} for 1.0: {outcome.reason}: {outcome.message}")
    assert outcome.verdict == "Fail" and outcome.reason in ("LogprobDrift", "NllDrift")
    assert probe(vllm_server, http, tiny_model, "A").verdict == "Pass"


def test_sinks_that_are_not_the_checkpoints_fail_the_probe(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    try:
        assert vllm_server.rpc(http, "hazard_set_sinks", SINK) == {"layers": 2}
        outcome = probe(vllm_server, http, tiny_model, "A")
    finally:
        vllm_server.rpc(http, "hazard_set_sinks", None)
    print(f"\nsink logits {SINK} the reference model lacks: {outcome.reason}: {outcome.message}")
    assert outcome.verdict == "Fail" and outcome.reason in ("LogprobDrift", "NllDrift")
    assert probe(vllm_server, http, tiny_model, "A").verdict == "Pass"


@needs_fp8_kv
def test_zeroed_kv_cache_scales_stop_the_cpu_engine(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    """#57163's end state, zeroed scales: vLLM's CPU kernel refuses a non-positive fp8 scale
    ("k_scale must be positive for FP8 path") at the first request and the engine dies, so
    the probe gets no logprobs (Inconclusive, which fails the refit). Last in the module:
    the server does not survive it."""
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    assert vllm_server.rpc(http, "hazard_set_kv_scales", 0.0) == {"layers": 2}
    ref = tiny_model.reference("A")
    with pytest.raises(httpx.HTTPStatusError) as failed:
        scores(vllm_server, http, ref)
    assert failed.value.response.status_code >= 500
    assert evaluate(ref, None, Thresholds()).reason == "ProbeNoData"
    assert "k_scale must be positive" in vllm_server.log_tail(400)
