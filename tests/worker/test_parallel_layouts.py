"""Refits of a model-parallel pod on real vLLM CPU: one server per layout for the module
(--tensor-parallel-size 2: VLLM::Worker_TP0/_TP1; pipeline parallelism: see LAYOUTS), started
from A's files with the refit-gloo engine and the test extension.

Every worker stages, verifies and loads (each answers /collective_rpc with its own result);
a checkpoint refit A -> B scores B's reference within 1e-4 and equals, token for token, a
fresh server of the same layout started from B's files; a broadcast gives the two workers
ranks 1 and 2 of world size 3 (the trainer and the /get_world_size receivers) and loads B on
both. A refusal on either worker is a refusal on both, before either touches the model (the
scores stay A's), and later calls still get their own replies (refit_worker.peers). The admin
guard and the fencing token sit in front of every worker: a call without the token or with a
stale fence reaches none. The pod's staging budget is shared by its workers.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from refit_worker import broadcast, checkpoint
from refit_worker.contract import FENCE_HEADER, TRANSFER_BACKEND, parse_rejection

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.broadcast import post
from tests.fixtures.reload import admin, assert_matches, differs, scores, swap

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP = 2  # workers per pod, in either layout
# layout -> (vLLM's flag, the workers' process title prefix)
# Pipeline parallelism 2 starts on vLLM 0.32 CPU (VLLM::Worker_PP0/_PP1, refit_info reports
# PP 2), but its engine dies on the first /v1/completions with prompt_logprobs (the probe's
# request): EngineDeadError, before any refit. Not a layout this module can refit and probe.
LAYOUTS = {
    "tensor": ("--tensor-parallel-size", "VLLM::Worker_TP"),
}
FRESH_TOL = 1e-4  # fp32 refit vs fp32 fresh load of the same layout
HAZARDS = "tests.worker.hazard_extension.HazardExtension"
BUDGET = 64 * 2**20  # the pod's staging budget: each of the two workers gets half
Scores = list[list[float | None]]
# vLLM's CPU build binds each worker's OpenMP threads to a NUMA node of its own by default and
# refuses two workers on a one-node machine ("Not enough allowed NUMA nodes to bind threads of
# 2 local CPUWorkers. Allowed NUMA nodes are [0]."): the workers share the cores unbound.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def layout_args(layout: str, *extra: str) -> list[str]:
    return [LAYOUTS[layout][0], str(TP), "--worker-extension-cls", HAZARDS, *extra]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def root(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp-root")
    for name in ("A", "B"):
        shutil.copytree(tiny_model.checkpoints[name], root / name)
    return root


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel, root: Path, layout: str) -> Iterator[VllmServer]:
    config = json.dumps({"backend": TRANSFER_BACKEND})
    env = {"REFIT_ALLOWED_ROOT": str(root), checkpoint.STAGING_BUDGET_ENV: str(BUDGET), **TP_ENV}
    with start_vllm_server(
        tiny_model,
        api_key="test-api-key",
        load_format="safetensors",
        model_dir=root / "A",
        env=env,
        extra_args=layout_args(layout, "--weight-transfer-config", config),
    ) as server:
        yield server


def rpc_all(server: VllmServer, method: str, *args: Any, **headers: str) -> list[Any]:
    """Every worker's result of one /collective_rpc, in worker order."""
    r = post(server, "/collective_rpc", {"method": method, "args": list(args)}, **headers)
    assert r.status_code == 200, r.text[:500]
    return list(r.json()["results"])


def refusal(server: VllmServer, method: str, *args: Any) -> tuple[str, str]:
    r = post(server, "/collective_rpc", {"method": method, "args": list(args)})
    assert r.status_code == 500, r.text[:300]
    parsed = parse_rejection(r.text)
    assert parsed is not None, r.text[:500]
    return parsed


def versions(server: VllmServer) -> list[str]:
    return [info["weight_version"] for info in rpc_all(server, "refit_info")]


def staged_refit(server: VllmServer, http: httpx.Client, path: Path, version: str) -> Any:
    staged = rpc_all(server, "refit_stage", str(path))
    return staged, swap(server, http, str(path), version)


def test_the_server_runs_two_workers(
    vllm_server: VllmServer, http: httpx.Client, layout: str
) -> None:
    assert admin(vllm_server, http, "GET", "/get_world_size")["world_size"] == TP
    titles = sorted(t for t, _ in vllm_server.processes() if t.startswith("VLLM::Worker"))
    assert titles == [f"{LAYOUTS[layout][1]}{i}" for i in range(TP)]
    infos = rpc_all(vllm_server, "refit_info")
    sizes = {"tensor": (TP, 1), "pipeline": (1, TP)}[layout]
    for info in infos:
        assert (info["tensor_parallel_size"], info["pipeline_parallel_size"]) == sizes
        assert info["data_parallel_size"] == 1
    assert len(infos) == TP


def test_every_worker_stages_verifies_and_loads_B(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path, layout: str
) -> None:
    ref_a, ref_b = tiny_model.reference("A"), tiny_model.reference("B")
    assert_matches(scores(vllm_server, http, ref_a), ref_a)  # started from A's files
    staged, loaded = staged_refit(vllm_server, http, root / "B", "B")
    assert len(staged) == TP
    for worker in staged:  # each worker checked every tensor and holds its share
        assert worker["tensorParallelSize"] == (TP if layout == "tensor" else 1)
        assert worker["podWorkers"] == TP
        assert worker["staged"] == "memory" and worker["budgetBytes"] == BUDGET // TP
        assert worker["parameters"] > 0
    assert loaded["source"] == "memory"
    assert versions(vllm_server) == ["B", "B"]
    assert_matches(scores(vllm_server, http, ref_b), ref_b)


def test_a_refitted_pod_equals_a_fresh_load_of_the_same_layout(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path, layout: str
) -> None:
    ref_b = tiny_model.reference("B")
    staged_refit(vllm_server, http, root / "A", "A")
    staged_refit(vllm_server, http, root / "B", "B")
    refitted = scores(vllm_server, http, ref_b)
    env = {"REFIT_ALLOWED_ROOT": str(root), **TP_ENV}
    with start_vllm_server(
        tiny_model,
        load_format="safetensors",
        model_dir=root / "B",
        env=env,
        extra_args=layout_args(layout),
    ) as fresh:
        expected = scores(fresh, http, ref_b)
    worst = max(
        abs(a - b)  # type: ignore[operator]
        for got, want in zip(refitted, expected, strict=True)
        for a, b in zip(got[1:], want[1:], strict=True)
    )
    assert worst <= FRESH_TOL, worst


def test_a_refusal_on_one_worker_leaves_every_worker_on_the_old_weights(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    ref_a, ref_b = tiny_model.reference("A"), tiny_model.reference("B")
    staged_refit(vllm_server, http, root / "A", "A")
    before = scores(vllm_server, http, ref_a)
    rpc_all(vllm_server, "refit_stage", str(root / "B"))
    marked = rpc_all(vllm_server, "hazard_stale_staged_identity", 1)
    assert [m["worker"] for m in marked] == [0, 1]
    assert marked[0]["changed"] == "" and marked[1]["changed"].endswith(".safetensors")
    admin(vllm_server, http, "POST", "/sleep", params={"level": 1})
    admin(vllm_server, http, "POST", "/wake_up", params={"tags": "weights"})
    try:
        code, detail = refusal(vllm_server, "refit_load", str(root / "B"), "B")
    finally:
        admin(vllm_server, http, "POST", "/wake_up", params={"tags": "kv_cache"})
    assert code == "CheckpointChanged", detail
    assert "changed since it was staged" in detail, detail
    assert versions(vllm_server) == ["A", "A"]
    after = scores(vllm_server, http, ref_a)
    assert after == before
    assert differs(after, ref_b) > 10 * FRESH_TOL
    # The next refit loads on both.
    staged_refit(vllm_server, http, root / "B", "B")
    assert_matches(scores(vllm_server, http, ref_b), ref_b)


def test_a_refusal_on_the_first_worker_is_answered_for_the_pod_and_later_calls_stay_in_step(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    """vLLM's collective_rpc stops reading replies at the first failed worker: without
    refit_worker.peers the second worker's reply would answer the next call."""
    staged_refit(vllm_server, http, root / "A", "A")
    rpc_all(vllm_server, "refit_stage", str(root / "B"))
    rpc_all(vllm_server, "hazard_stale_staged_identity", 0)
    code, detail = refusal(vllm_server, "refit_load", str(root / "B"), "B")
    assert code == "CheckpointChanged", detail
    assert detail.startswith("worker 0 (CheckpointChanged) of this pod's 2 refused"), detail
    # Every later call gets its own replies, from both workers.
    for _ in range(3):
        assert versions(vllm_server) == ["A", "A"]
        admin(vllm_server, http, "POST", "/reset_prefix_cache")
    code, _detail = refusal(vllm_server, "refit_preflight", str(root / "missing"))
    assert code == "CheckpointMissing"
    assert versions(vllm_server) == ["A", "A"]
    assert_matches(scores(vllm_server, http, tiny_model.reference("A")), tiny_model.reference("A"))


def test_the_guard_and_the_fence_stand_before_every_worker(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    staged_refit(vllm_server, http, root / "A", "A")
    body = {"method": "refit_load", "args": [str(root / "B"), "B"]}
    r = httpx.post(vllm_server.base_url + "/collective_rpc", json=body, timeout=60)
    assert r.status_code == 401, r.text[:300]
    assert rpc_all(vllm_server, "refit_info", **{FENCE_HEADER: "7"})  # the mark is 7
    r = post(vllm_server, "/collective_rpc", body, **{FENCE_HEADER: "6"})
    assert r.status_code == 409 and "StaleFence" in r.text, r.text[:300]
    assert versions(vllm_server) == ["A", "A"]  # no worker ran either call
    assert_matches(scores(vllm_server, http, tiny_model.reference("A")), tiny_model.reference("A"))
    staged = rpc_all(vllm_server, "refit_stage", str(root / "B"), **{FENCE_HEADER: "7"})
    assert len(staged) == TP


def test_a_broadcast_ranks_each_worker_and_loads_B_on_both(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path, layout: str
) -> None:
    staged_refit(vllm_server, http, root / "A", "A")
    tensors = broadcast.load_tensors(root / "B")
    world = admin(vllm_server, http, "GET", "/get_world_size")["world_size"] + 1
    assert world == TP + 1  # the trainer, rank 0, and one rank per worker
    sender = broadcast.Sender(world, timeout_seconds=120)
    try:
        with ThreadPoolExecutor(1) as pool:
            init = {"init_info": sender.init_info(1)}
            joined = pool.submit(post, vllm_server, "/init_weight_transfer_engine", init)
            sender.connect()
            assert joined.result().status_code == 200
        promise = broadcast.build_manifest(tensors)
        admin(vllm_server, http, "POST", "/pause", params={"mode": "wait"})
        try:
            assert post(vllm_server, "/start_weight_update").status_code == 200
            started = time.perf_counter()
            with ThreadPoolExecutor(1) as pool:
                update = pool.submit(
                    post,
                    vllm_server,
                    "/update_weights",
                    {"update_info": {"manifest": promise.to_json_dict()}},
                )
                sender.send(tensors)
                answer = update.result()
            assert answer.status_code == 200, answer.text[:300]
            print(f"\n{layout} x{TP} broadcast round: {time.perf_counter() - started:.3f} s")
            admin(vllm_server, http, "POST", "/finish_weight_update", json={"weight_version": "B"})
            admin(vllm_server, http, "POST", "/reset_prefix_cache")
        finally:
            admin(vllm_server, http, "POST", "/resume")
    finally:
        sender.close()
    received = rpc_all(vllm_server, "refit_received", promise.digest, "B-broadcast")
    assert [(r["rank"], r["worldSize"]) for r in received] == [(1, world), (2, world)]
    assert {(r["state"], r["digest"]) for r in received} == {("loaded", promise.digest)}
    assert versions(vllm_server) == ["B-broadcast", "B-broadcast"]
    assert_matches(scores(vllm_server, http, tiny_model.reference("B")), tiny_model.reference("B"))
