"""Contract: the simulated worker answers like a real vLLM CPU pod with the refit_worker plugin.

The same WorkerClient calls run against a real server (tests/support/vllm_testbed.py) and
against the simulator; an httpx response hook records every answer. For each call both
must agree on: the path and RPC method, the HTTP status, the JSON shape of the body (keys
and value types, recursively; list elements as the set of their shapes; token-id keys as
one key), and the client's outcome (a result, or WorkerError kind/status/code). This covers
every WorkerClient method, the contract rejections (CheckpointMissing, PathNotAllowed,
ManifestMismatch), out-of-vocabulary tokens and the 401 of the admin guard and the api key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from refit_operator.worker import WorkerClient, WorkerError

from tests.support.simworker import SimFleet, make_sim_checkpoint
from tests.support.tiny_model import TinyModel
from tests.support.vllm_testbed import VllmServer

pytestmark = pytest.mark.vllm

VERSION = "contract-1"
# Free-form fields whose inner shape is nobody's contract.
FREE_FORM = frozenset({"extra"})


@dataclass(frozen=True)
class Target:
    base_url: str
    admin_token: str
    api_key: str | None
    good: Path  # a checkpoint this target loads
    mismatch: Path  # a checkpoint whose files differ from its manifest
    root: Path  # the allowed checkpoint root


def shape(value: Any, key: str = "") -> Any:
    """The JSON type structure of a value: what the two implementations must share."""
    if key in FREE_FORM:
        return type(value).__name__
    if isinstance(value, dict):
        if value and all(k.isdigit() for k in value):  # keyed by token id
            return {"<id>": distinct(shape(v) for v in value.values())}
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return ["list of", distinct(shape(v) for v in value)]
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def distinct(shapes: Iterable[Any]) -> list[Any]:
    unique = {json.dumps(s, sort_keys=True): s for s in shapes}
    return [unique[k] for k in sorted(unique)]


async def run_scenario(target: Target, token_ids: list[int]) -> list[Any]:
    """The same calls, in the same order, against one target; returns what was observed."""
    seen: list[Any] = []

    async def record(response: httpx.Response) -> None:
        await response.aread()
        request = response.request
        what = request.url.path
        if what == "/collective_rpc":
            what += ":" + json.loads(request.content)["method"]
        try:
            body = shape(response.json())
        except ValueError:
            body = "text"
        seen.append(("http", request.method, what, response.status_code, body))

    async with httpx.AsyncClient(event_hooks={"response": [record]}, timeout=120) as http:
        admin = WorkerClient(
            target.base_url, http=http, admin_token=target.admin_token, api_key=target.api_key
        )
        anonymous = WorkerClient(target.base_url, http=http)

        async def outcome(call: Awaitable[Any]) -> None:
            try:
                result = await call
            except WorkerError as exc:
                assert "stack trace" not in exc.message, exc.message
                seen.append(("error", exc.kind, exc.status, exc.code))
                return
            seen.append(("ok", type(result).__name__))

        calls: list[Callable[[], Awaitable[Any]]] = [
            admin.refit_info,
            admin.weight_version,
            admin.is_paused,
            lambda: admin.pause("wait"),
            admin.is_paused,
            admin.resume,
            lambda: admin.sleep(1),
            admin.is_sleeping,
            lambda: admin.wake_up(["weights"]),
            lambda: admin.wake_up(["kv_cache"]),
            admin.is_sleeping,
            admin.reset_prefix_cache,
            lambda: admin.preflight(str(target.good)),
            lambda: admin.load(str(target.good), VERSION),
            admin.refit_info,
            lambda: admin.probe_reference(str(target.good)),
            lambda: admin.update_weight_version(VERSION),
            admin.weight_version,
            lambda: admin.score(token_ids),
            admin.requests_in_flight,
            lambda: admin.preflight(str(target.root / "absent")),
            lambda: admin.preflight("/etc"),
            lambda: admin.preflight(str(target.mismatch)),
            lambda: admin.score([token_ids[0], 10**6]),
            lambda: anonymous.pause("wait"),
            anonymous.refit_info,
            lambda: anonymous.score(token_ids),
            anonymous.requests_in_flight,
        ]
        for call in calls:
            await outcome(call())
        assert (await admin.refit_info()).weight_version == VERSION
        assert await admin.weight_version() == VERSION
    return seen


@pytest.fixture(scope="module")
def real(vllm_server: VllmServer, tiny_model: TinyModel) -> Target:
    return Target(
        base_url=vllm_server.base_url,
        admin_token=vllm_server.admin_token,
        api_key=vllm_server.api_key,
        good=tiny_model.checkpoints["A"],
        mismatch=tiny_model.checkpoints["manifest_mismatch"],
        root=tiny_model.allowed_root,
    )


@pytest.fixture(scope="module")
def sim(
    vllm_server: VllmServer, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("sim-root")
    good = make_sim_checkpoint(root / "A", "A")
    mismatch = root / "manifest_mismatch"
    shutil.copytree(tiny_model.checkpoints["manifest_mismatch"], mismatch)
    fleet = SimFleet(
        1,
        admin_token=vllm_server.admin_token,
        api_key=vllm_server.api_key,
        allowed_root=root,
        vocab=tiny_model.vocab_size,
    )
    try:
        yield Target(
            fleet.pods[0].base_url,
            vllm_server.admin_token,
            vllm_server.api_key,
            good,
            mismatch,
            root,
        )
    finally:
        fleet.close()


def test_simulator_answers_with_the_real_shapes(
    real: Target, sim: Target, tiny_model: TinyModel
) -> None:
    token_ids = list(tiny_model.reference("A").prompts[0].token_ids)
    observed_real = asyncio.run(run_scenario(real, token_ids))
    observed_sim = asyncio.run(run_scenario(sim, token_ids))
    for i, (r, s) in enumerate(itertools.zip_longest(observed_real, observed_sim)):
        context = [o for o in observed_real[:i] if o[0] != "http"][-3:]
        assert s == r, f"observation {i} (after {context}):\n real {r}\n sim  {s}"
    rejected = [o[3] for o in observed_real if o[:2] == ("error", "rejected")]
    assert rejected == ["CheckpointMissing", "PathNotAllowed", "ManifestMismatch"]
    unauthorized = [o for o in observed_real if o[0] == "http" and o[3] == 401]
    assert len(unauthorized) == 3
