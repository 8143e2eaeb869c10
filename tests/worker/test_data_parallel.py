"""Data parallelism behind one API server, on real vLLM CPU: what it runs, and why the
operator refuses to refit it (WorkersOutOfReach).

vLLM 0.32's CPU build starts `--data-parallel-size 2` (dense model, workers unbound): one API
server, an engine core per rank (VLLM::EngineCore_DP0, _DP1), each with its own worker. The
API server counts both (/get_world_size answers 2); /collective_rpc reaches both engines but
answers with the first engine's results only, from a worker whose parallel config reports
DP 1 (each engine resets data_parallel_size to 1 for itself,
ParallelConfig.reconfigure_for_independent_dp_rank). The workers of an engine agree before a
load (refit_worker.peers), but engines do not: a refit through that API could load one engine
while the other refused, and would never see the other's version or read-back. The
operator's preflight sees the two counts disagree and refuses the pod before any call that
changes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from refit_operator.core import admission
from refit_operator.core.reasons import Reason
from refit_operator.edges.worker_client import WorkerClient
from refit_worker.contract import RefitInfo

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.reload import admin

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DP = 2
# Two CPU workers on a one-NUMA-node machine: vLLM's default binding refuses them (see
# test_parallel_layouts.TP_ENV).
DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    with start_vllm_server(
        tiny_model,
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        env=DP_ENV,
        extra_args=[
            "--data-parallel-size",
            str(DP),
            "--worker-extension-cls",
            "tests.worker.hazard_extension.HazardExtension",
        ],
    ) as server:
        yield server


def rpc(server: VllmServer, http: httpx.Client, method: str, *args: Any) -> list[Any]:
    body = {"method": method, "args": list(args)}
    return list(admin(server, http, "POST", "/collective_rpc", json=body)["results"])


def test_the_api_server_counts_two_workers_and_answers_for_one(
    vllm_server: VllmServer, http: httpx.Client, tmp_path: Path
) -> None:
    assert admin(vllm_server, http, "GET", "/get_world_size")["world_size"] == DP
    titles = sorted(t for t, _ in vllm_server.processes() if t.startswith("VLLM::EngineCore"))
    assert titles == [f"VLLM::EngineCore_DP{i}" for i in range(DP)]
    answered = set()
    for _ in range(3):
        infos = rpc(vllm_server, http, "refit_info")
        assert len(infos) == 1, infos
        assert (infos[0]["tensor_parallel_size"], infos[0]["pipeline_parallel_size"]) == (1, 1)
        assert infos[0]["data_parallel_size"] == 1  # the engine's own view, reset per rank
        marks = rpc(vllm_server, http, "hazard_mark_process", str(tmp_path))
        assert len(marks) == 1, marks
        answered.add(marks[0]["pid"])
    # Every call reached both engines' workers; the answers came from the same one.
    reached = {int(p.name.removeprefix("worker-")) for p in tmp_path.iterdir()}
    assert len(reached) == DP, reached
    assert len(answered) == 1 and answered < reached, (answered, reached)


def test_the_operator_refuses_the_pod_as_workers_out_of_reach(vllm_server: VllmServer) -> None:
    """What the engine's preflight and a late pod's admission read, through the operator's
    own client, judged by the same function: a specific refusal, not a half-refitted pod."""

    async def read() -> tuple[RefitInfo, int]:
        async with aiohttp.ClientSession() as http:
            client = WorkerClient(
                vllm_server.base_url, http=http, admin_token=vllm_server.admin_token
            )
            return await client.refit_info(), await client.world_size()

    info, world_size = asyncio.run(read())
    assert world_size == DP
    problem = admission.world_size_problem({"vllm-0": info}, {"vllm-0": world_size})
    assert problem is not None
    assert problem.reason == Reason.WorkersOutOfReach
    assert problem.message.startswith(
        "pod vllm-0: /get_world_size counts 2 workers but refit_info answers for 1 (TP1 PP1 DP1)"
    ), problem.message
