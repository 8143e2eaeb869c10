"""Verified reload on a real vLLM CPU engine: dummy start -> A -> B, broken checkpoints refused
before they touch the model, a mixed checkpoint that loads (only a probe can catch it)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from refit_worker.contract import PROBE_FILE, ProbeReference

from testbed.tiny_model import EXPECTED_REJECTION, TinyModel
from testbed.vllm_server import VllmServer
from tests.fixtures.reload import (
    NLL_TOL,
    TOKEN_TOL,
    assert_matches,
    differs,
    refit_cycle,
    rejection,
    scores,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_dummy_start_then_refit_A_matches_the_hf_reference(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    ref = tiny_model.reference("A")
    assert vllm_server.rpc(http, "refit_info")["weight_version"] == "default"
    dummy = scores(vllm_server, http, ref)
    assert differs(dummy, ref) > 0.5  # dummy weights are nowhere near A
    loaded = refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    assert loaded["switchedLoadFormatFrom"] == "dummy"
    assert_matches(scores(vllm_server, http, ref), ref)
    assert vllm_server.rpc(http, "refit_info")["weight_version"] == "A"


def test_refit_A_to_B_matches_the_hf_reference(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    ref_a, ref_b = tiny_model.reference("A"), tiny_model.reference("B")
    assert differs(scores(vllm_server, http, ref_b), ref_b) > 10 * NLL_TOL  # still A
    loaded = refit_cycle(vllm_server, http, str(tiny_model.checkpoints["B"]), "B")
    assert loaded["switchedLoadFormatFrom"] is None
    got = scores(vllm_server, http, ref_b)
    assert_matches(got, ref_b)
    assert differs(got, ref_a) > 10 * NLL_TOL


@pytest.mark.parametrize("variant", sorted(EXPECTED_REJECTION))
def test_broken_checkpoint_is_refused_and_A_keeps_serving(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, variant: str
) -> None:
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["A"]), "A")
    ref = tiny_model.reference("A")
    before = scores(vllm_server, http, ref)
    path = str(tiny_model.checkpoints[variant])
    for method, args in (("refit_preflight", (path,)), ("refit_load", (path, "broken"))):
        code, detail = rejection(vllm_server, http, method, *args)
        assert code == EXPECTED_REJECTION[variant], detail
    after = scores(vllm_server, http, ref)
    assert after == before  # untouched, bit for bit
    assert_matches(after, ref)
    assert vllm_server.rpc(http, "refit_info")["weight_version"] == "A"


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/etc", "PathNotAllowed"),
        ("relative/dir", "PathNotAllowed"),
        ("{root}/A/../B", "PathNotAllowed"),
        ("{root}/does-not-exist", "CheckpointMissing"),
    ],
)
def test_bad_paths_are_refused(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, path: str, code: str
) -> None:
    path = path.format(root=tiny_model.allowed_root)
    assert rejection(vllm_server, http, "refit_preflight", path)[0] == code
    assert rejection(vllm_server, http, "refit_probe_reference", path)[0] == code


def test_mixed_checkpoint_loads_and_matches_neither_reference(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    refit_cycle(vllm_server, http, str(tiny_model.checkpoints["mixed"]), "mixed")
    ref_a, ref_b = tiny_model.reference("A"), tiny_model.reference("B")
    got = scores(vllm_server, http, ref_a)
    assert tiny_model.reference("mixed") == ref_a  # it claims to be A
    assert differs(got, ref_a) > 10 * NLL_TOL
    assert differs(got, ref_b) > 10 * NLL_TOL
    worst_a = max(
        abs(a - b)  # type: ignore[operator]
        for lps, p in zip(got, ref_a.prompts, strict=True)
        for a, b in zip(lps[1:], p.logprobs[1:], strict=True)
    )
    assert worst_a > 10 * TOKEN_TOL


def test_probe_reference_rpc_returns_the_checkpoint_file(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    doc = vllm_server.rpc(http, "refit_probe_reference", str(tiny_model.checkpoints["B"]))
    on_disk = json.loads((tiny_model.checkpoints["B"] / PROBE_FILE).read_text())
    assert ProbeReference.from_json_dict(doc) == ProbeReference.from_json_dict(on_disk)
    assert doc["version"] == "B"


def test_twenty_refits_keep_rss_flat(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client
) -> None:
    """Also prints the timings reported in the issue note (run with -s)."""
    ref = tiny_model.reference("A")
    ckpts = tiny_model.checkpoints
    refit_cycle(vllm_server, http, str(ckpts["A"]), "A")
    scores(vllm_server, http, ref)  # warm-up
    rss_before = vllm_server.rss_bytes()
    cycles, probes = [], []
    for i in range(20):
        name = "B" if i % 2 == 0 else "A"
        t0 = time.perf_counter()
        refit_cycle(vllm_server, http, str(ckpts[name]), f"{name}-{i}")
        cycles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = scores(vllm_server, http, tiny_model.reference(name))
        probes.append((time.perf_counter() - t0) / len(got))
        assert_matches(got, tiny_model.reference(name))
    rss_after = vllm_server.rss_bytes()
    by_process = {k: f"{v / 2**20:.0f} MiB" for k, v in vllm_server.rss_by_process().items()}
    cycles.sort()
    probes.sort()
    print(
        f"\nrefit measurements: server start {vllm_server.started_seconds:.1f} s; "
        f"refit cycle median {cycles[10] * 1e3:.0f} ms (max {cycles[-1] * 1e3:.0f} ms); "
        f"NLL probe per prompt median {probes[10] * 1e3:.0f} ms; "
        f"RSS before {rss_before / 2**20:.0f} MiB, after 20 refits {rss_after / 2**20:.0f} MiB "
        f"({by_process})"
    )
    assert rss_before > 0
    # Noise on a ~3 GB process is tens of MiB; a leak of the 3 MB checkpoint per refit is not.
    assert rss_after - rss_before < 64 * 2**20
