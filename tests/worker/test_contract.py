"""Contract: the simulated worker answers like a real vLLM CPU pod with the refit_worker plugin.

The same WorkerClient calls run against a real server (testbed/vllm_server.py) and
against the simulator; a client middleware on the aiohttp session records every answer. For
each call both must agree on: the path and RPC method, the HTTP status, the JSON shape of the
body (keys and value types, recursively; list elements as the set of their shapes; token-id
keys as one key), and the client's outcome (a result, or WorkerError kind/status/code). This covers
every WorkerClient method, the contract rejections (CheckpointMissing, PathNotAllowed,
ManifestMismatch, at preflight and at refit_stage), out-of-vocabulary tokens and the 401 of the
admin guard and the api key, and the readiness probe (503 until a pass vouches, then 200).
refit_stage then refit_load must also agree on where the bytes were staged and loaded from
(``staged``, ``source``: both "memory" under the default budget).
Several prompts in one completions request (score_prompts) must also agree on the choices'
indices in answer order, each choice's prompt_logprobs length and the summed usage; one bad
prompt among them (out of vocabulary, empty) fails the whole request on both. Fencing
(X-Refit-Fence) must agree too: a stale token is refused with the same 409 and body on any
state-changing path, reads and calls without the header pass, a malformed one is the same 400.
Pause, sleep and wake are compared with completions in flight and queued: every pause mode,
sleep levels 0-2 (and bad ones), wake tags, /health and unknown paths. LoRA adapters are
compared on a second, LoRA-enabled server (runtime updating on) against a simulated fleet with
LoRA on: vLLM's load and unload routes behind the guard (success texts, refusals and their
messages, 401s, a stale fence), the adapter cards /v1/models lists, completions through an
adapter (one prompt per request) and for an unknown one, and refit_adapter_check's answers and
refusals (the path rules, the manifest, a PEFT LoRA config, and whether the adapter fits the
engine: its rank, its modules and their sizes, which the real check reads from vLLM's LoRA
manager and the simulator from SIM_LORA_MODULES); without runtime updating (the shared
server) both routes are FastAPI's 404. The last test checks that every route the simulator
serves was compared. What a CPU server cannot show is listed in
testbed/simworker/model.py's SIM_UNSHOWN instead.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from refit_operator.edges.worker_client import WorkerClient, WorkerError
from refit_worker import contract
from refit_worker.checkpoint import write_manifest

from testbed.simworker import (
    HTTP_STEPS,
    PAUSE_MODES,
    SIM_UNSHOWN,
    make_sim_adapter,
    make_sim_checkpoint,
)
from testbed.simworker.fleet import SimFleet
from testbed.tiny_adapter import ensure_tiny_adapters
from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.loopback import connection_counter

pytestmark = pytest.mark.vllm

# The adapter comparisons' server (as tests/worker/test_lora_adapter.py starts it): the
# module's shared server runs without LoRA, because on a LoRA-enabled vLLM 0.32 CPU server a
# batch of prompt-logprob sequences kills the engine, and run_scenario scores batches.
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

VERSION = "contract-1"
# The paths and query parameters this module sent to the real server (the last test checks
# that they cover everything the simulator serves).
COMPARED: set[tuple[str, str]] = set()
# Free-form fields whose inner shape is nobody's contract.
FREE_FORM = frozenset({"extra"})
# Answers keyed by tensor name (the weight checker's, the buffer digests'): the real model has
# its tensors, the simulator one of each kind; both must key them the same way (below).
TENSOR_KEYED = frozenset({"checksums", "buffers"})
# Result fields whose values (not only types) both must agree on.
ENUM_FIELDS = ("staged", "source", "switchedLoadFormatFrom")


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
    if key in TENSOR_KEYED and isinstance(value, dict):
        return {"<tensor>": distinct(shape(v) for v in value.values())}
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


def completion_counts(doc: Any) -> Any:
    """What a completions answer must agree on beyond its shape: which prompt each choice
    belongs to (in answer order), how many tokens each scored, and the usage."""
    choices = [(c["index"], len(c["prompt_logprobs"])) for c in doc["choices"]]
    usage = doc["usage"]
    return choices, [usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")]


async def run_scenario(target: Target, prompts: list[list[int]]) -> list[Any]:
    """The same calls, in the same order, against one target; returns what was observed."""
    seen: list[Any] = []
    token_ids = prompts[0]

    async def record(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        response = await handler(request)
        raw = await response.read()  # kept by the response: the client reads it again
        what = request.url.path
        if what == "/collective_rpc":
            assert isinstance(request.body, aiohttp.Payload)  # the JSON the client sent
            what += ":" + json.loads(await request.body.as_bytes())["method"]
        try:
            doc = json.loads(raw)
        except ValueError:
            body: Any = "text"
        else:
            body = shape(doc)
        seen.append(("http", request.method, what, response.status, body))
        COMPARED.add((request.url.path, ""))
        if what == "/v1/completions" and response.status == 200:
            seen.append(("counts", completion_counts(doc)))
        return response

    async with aiohttp.ClientSession(middlewares=(record,)) as http:
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
            if isinstance(result, tuple):  # buffer_digests: (dtype, digests)
                result = result[1]
            if (
                isinstance(result, dict)
                and result
                and all(isinstance(v, str) and len(v) == 64 for v in result.values())
            ):
                # Per-tensor SHA-256 digests: keyed by the worker's rank prefix, hex.
                prefixes = sorted({k.rsplit(":", 1)[0] for k in result})
                hexes = all(set(v) <= set("0123456789abcdef") for v in result.values())
                seen.append(("digests", prefixes, hexes))
            if isinstance(result, dict):
                # refit_stage's and refit_load's enumerations are contract values, not text.
                enums = {k: result[k] for k in ENUM_FIELDS if k in result}
                if enums:
                    seen.append(("values", enums))

        async def bound_vouch(client: WorkerClient) -> None:
            await client.mark_ready(VERSION, process=await client.process_identity())

        async def ready() -> int:  # the kubelet's readiness probe: no credentials
            async with http.get(target.base_url + contract.READY_PATH) as r:
                return r.status

        calls: list[Callable[[], Awaitable[Any]]] = [
            ready,  # 503: nothing stamped in this process
            admin.refit_info,
            admin.world_size,  # one worker: every worker the API server counts answers
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
            lambda: admin.stage(str(target.mismatch)),
            lambda: admin.stage(str(target.good)),
            lambda: admin.stage(str(target.good)),  # again, unchanged: reused
            lambda: admin.load(str(target.good), VERSION),
            admin.refit_info,
            lambda: admin.probe_reference(str(target.good)),
            admin.weight_checksums,  # the read-back: vLLM's weight checker, and the buffers
            admin.buffer_digests,
            lambda: admin.update_weight_version(VERSION),
            ready,  # still 503: loaded and stamped, not vouched for
            lambda: admin.mark_ready(""),  # 400
            lambda: anonymous.mark_ready(VERSION),  # 401
            admin.process_identity,  # this process, vouched for or not
            lambda: admin.mark_ready(VERSION, process="another-process"),  # 409 ProcessChanged
            ready,  # still 503
            lambda: admin.mark_ready(VERSION),
            ready,  # 200
            lambda: bound_vouch(admin),  # bound to this process: admitted
            admin.weight_version,
            lambda: admin.score(token_ids),
            admin.requests_in_flight,
            lambda: admin.preflight(str(target.root / "absent")),
            lambda: admin.preflight("/etc"),
            lambda: admin.preflight(str(target.mismatch)),
            lambda: admin.score([token_ids[0], 10**6]),
            lambda: admin.score_prompts(prompts),
            lambda: admin.score_prompts([prompts[2], prompts[0], prompts[2]]),
            lambda: admin.score_prompts([prompts[0], [prompts[1][0], 10**6], prompts[2]]),
            lambda: admin.score_prompts([prompts[0], []]),
            lambda: anonymous.pause("wait"),
            anonymous.refit_info,
            lambda: anonymous.score(token_ids),
            anonymous.requests_in_flight,
            anonymous.weight_checksums,  # 401: the weight checker is an admin path
            anonymous.world_size,  # 401: vLLM's dev endpoints sit behind the guard
        ]
        for call in calls:
            await outcome(call())
        assert (await admin.refit_info()).weight_version == VERSION
        assert await admin.weight_version() == VERSION
        seen.append(("world_size", await admin.world_size()))
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
def vllm_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    """The module's dummy-start server (as tests/fixtures/workers.py starts it), with the
    refit-gloo weight-transfer engine: the transfer routes the simulator serves are compared
    with it too."""
    config = json.dumps({"backend": contract.TRANSFER_BACKEND})
    with start_vllm_server(
        tiny_model, api_key="test-api-key", extra_args=["--weight-transfer-config", config]
    ) as server:
        yield server


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
    prompts = [list(p.token_ids) for p in tiny_model.reference("A").prompts]
    assert len(prompts) >= 3
    observed_real = asyncio.run(run_scenario(real, prompts))
    observed_sim = asyncio.run(run_scenario(sim, prompts))
    for i, (r, s) in enumerate(itertools.zip_longest(observed_real, observed_sim)):
        context = [o for o in observed_real[:i] if o[0] != "http"][-3:]
        assert s == r, f"observation {i} (after {context}):\n real {r}\n sim  {s}"
    values = [o[1] for o in observed_real if o[0] == "values"]
    assert values == [
        {"staged": "memory"},
        {"staged": "memory"},
        {"source": "memory", "switchedLoadFormatFrom": "dummy"},
    ]
    rejected = [o[3] for o in observed_real if o[:2] == ("error", "rejected")]
    assert rejected == [
        "ManifestMismatch",
        "ProcessChanged",  # a vouch bound to another process than the pod's
        "CheckpointMissing",
        "PathNotAllowed",
        "ManifestMismatch",
    ]
    readiness = [o[3] for o in observed_real if o[:3] == ("http", "GET", contract.READY_PATH)]
    # the kubelet's probes, and the process identity read before the vouches: 503 until the
    # (unbound) vouch, then 200
    assert readiness == [503, 503, 503, 503, 200, 200]
    unauthorized = [o for o in observed_real if o[0] == "http" and o[3] == 401]
    assert len(unauthorized) == 6
    assert ("world_size", 1) in observed_real  # one worker, as refit_info's layout says
    digests = [o[1:] for o in observed_real if o[0] == "digests"]
    assert digests == [(["dp0:pp0:pcp0:tp0"], True), (["dp0:pp0:pcp0:tp0"], True)]
    batches = [o[1][0] for o in observed_real if o[0] == "counts" and len(o[1][0]) > 1]
    lengths = [len(p) for p in prompts]
    assert batches == [
        list(enumerate(lengths)),
        list(enumerate([lengths[2], lengths[0], lengths[2]])),
    ]
    statuses = [o[2] for o in observed_real if o[:2] == ("error", "http")]
    # an empty vouch, an anonymous vouch; bad token, bad batch, empty prompt; anonymous calls
    assert statuses == [400, 401, 400, 400, 400, 401, 401, 401, 401, 401]


async def run_fencing(target: Target) -> list[Any]:
    """Two passes drive one pod with fencing tokens; the older one must be refused."""
    seen: list[Any] = []
    # Above any token another test of this module may have sent (none sends one today).
    newer_token, older_token = (7 << 32) | 2, (7 << 32) | 1
    async with aiohttp.ClientSession() as http:

        def make(token: int | None) -> WorkerClient:
            return WorkerClient(
                target.base_url,
                http=http,
                admin_token=target.admin_token,
                api_key=target.api_key,
                fence=token,
            )

        newer, older, anyone = make(newer_token), make(older_token), make(None)

        async def outcome(call: Awaitable[Any]) -> None:
            try:
                result = await call
            except WorkerError as exc:
                seen.append(("error", exc.kind, exc.status, exc.code, exc.message))
                return
            seen.append(("ok", result))

        async def raw(path: str, value: str, body: Any = None) -> None:
            headers = {
                "Authorization": f"Bearer {target.admin_token}",
                contract.FENCE_HEADER: value,
            }
            async with http.post(target.base_url + path, headers=headers, json=body) as r:
                seen.append(("raw", path, r.status, await r.json()))

        await outcome(newer.reset_prefix_cache())  # admitted: the pod's mark is now newer
        await outcome(older.reset_prefix_cache())  # refused
        await outcome(older.refit_info())  # refused on /collective_rpc too
        await outcome(older.resume())
        await outcome(older.is_paused())  # a read: not refused
        await outcome(newer.resume())  # equal: admitted
        await outcome(anyone.resume())  # no header: admitted
        await raw("/resume", str(older_token))  # the refusal's exact body
        await raw("/collective_rpc", str(older_token), {"method": "refit_info"})
        await raw("/resume", "not-a-number")
        await raw("/resume", "-3")
        await outcome(older.resume())  # still refused: refusals did not move the mark
    return seen


def test_simulator_fences_like_the_real_guard(real: Target, sim: Target) -> None:
    observed_real = asyncio.run(run_fencing(real))
    observed_sim = asyncio.run(run_fencing(sim))
    assert observed_sim == observed_real
    stale = [o for o in observed_real if o[0] == "error"]
    assert [o[1:4] for o in stale] == [("rejected", 409, contract.STALE_FENCE)] * 4
    assert "another refit pass owns this pod" in stale[0][4]
    raw = [o[1:3] for o in observed_real if o[0] == "raw"]
    assert raw == [("/resume", 409), ("/collective_rpc", 409), ("/resume", 400), ("/resume", 400)]
    assert observed_real[-2][3]["error"]["message"] == "X-Refit-Fence header '-3' is negative"


async def run_lifecycle(target: Target, prompt: list[int]) -> list[Any]:
    """Every route and parameter of pause, sleep and wake, /health and unknown paths, with
    completions in flight and queued: what both must agree on (statuses, body shapes, the
    switches' values, finish reasons, and whether a request was answered yet)."""
    seen: list[Any] = []
    admin = {"Authorization": f"Bearer {target.admin_token}"}
    key = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with aiohttp.ClientSession() as http:
        model = await WorkerClient(target.base_url, http=http, api_key=target.api_key).model_name()

        async def call(method: str, path: str, params: Any = None, auth: Any = admin) -> Any:
            async with http.request(
                method, target.base_url + path, params=params, headers=auth
            ) as r:
                raw = await r.read()
            for name, value in dict(params or {}).items():
                COMPARED.add((path, f"{name}={value}"))
            COMPARED.add((path, ""))
            try:
                doc = json.loads(raw)
            except ValueError:
                seen.append((method, path, params, r.status, "text"))
                return None
            seen.append((method, path, params, r.status, shape(doc)))
            if r.status != 200 and isinstance(doc, dict):  # what a refusal names
                error = doc.get("error")
                named = error.get("param") if isinstance(error, dict) else error
                seen.append(("refused", doc.get("detail", named)))
            return doc

        async def state(what: str) -> None:
            paused = (await call("GET", "/is_paused"))["is_paused"]
            sleeping = (await call("GET", "/is_sleeping"))["is_sleeping"]
            seen.append((what, "paused", paused, "sleeping", sleeping))

        def complete(tokens: int, copies: int = 1) -> asyncio.Task[Any]:
            body = {"model": model, "prompt": [prompt] * copies, "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip

            async def go() -> Any:
                async with http.post(
                    target.base_url + "/v1/completions", json=body, headers=key
                ) as r:
                    doc = await r.json()
                last = max(doc["choices"], key=lambda c: c["index"])
                return r.status, last["finish_reason"]

            return asyncio.create_task(go())

        async def decoding(copies: int) -> asyncio.Task[Any]:
            """A long completion, decoding: the tiny model decodes 500 tokens in a fraction of
            a second, so several prompts of them (the last prompt's answer tells)."""
            task = complete(500, copies)  # with the 8-token prompt, 512 positions
            await asyncio.sleep(0.2 if copies > 8 else 0.05)
            assert not task.done(), f"{target.base_url}: the long completion already ended"
            return task

        async def queued_answered(what: Any, task: asyncio.Task[Any]) -> None:
            await asyncio.sleep(0.3)
            seen.append((what, "queued answered", task.done()))

        await call("GET", "/health", auth={})
        await call("GET", "/no-such-path")
        await call("POST", "/no-such-path")
        await call("GET", "/no-such-path", auth={})
        await call("GET", "/v1/no-such-path", auth=key)
        await call("POST", "/pause", {"mode": "bogus"})
        await call("POST", "/sleep", {"level": "3"})
        await call("POST", "/sleep", {"level": "x"})
        await call("POST", "/sleep", {"level": "1", "mode": "bogus"})
        for mode in PAUSE_MODES:
            # A wait drains only the sequences scheduled (--max-num-seqs 8): the rest of a
            # longer request queues like a new one, where the simulator drains all of it.
            inflight = await decoding(8 if mode == "wait" else 64)
            await call("POST", "/pause", {"mode": mode})
            if mode == "wait":  # finished by the time the pause answers (its body may trail)
                await asyncio.wait([inflight], timeout=2)
                seen.append(("wait: in flight answered", inflight.done()))
            await state(f"paused {mode}")
            queued = complete(2)
            await queued_answered(mode, queued)
            if mode == "keep":  # frozen
                seen.append(("keep: in flight answered while paused", inflight.done()))
            await call("POST", "/resume")
            await state("resumed")
            seen.append((mode, "in flight", await inflight, "queued", await queued))
        # The pass's own sequence: a wait drain, then a sleep in mode abort ends what queued.
        await call("POST", "/pause", {"mode": "wait"})
        queued = complete(2)
        await queued_answered("paused wait", queued)
        await call("POST", "/sleep", {"level": "1", "mode": "abort"})
        await queued_answered("asleep with mode abort", queued)
        await call("POST", "/wake_up")
        seen.append(("aborted by the sleep", await queued))
        for level in ("0", "1", "2"):
            await call("POST", "/sleep", {"level": level, "mode": "wait"})
            await state(f"asleep {level}")
            queued = complete(2)
            await call("POST", "/sleep", {"level": level, "mode": "keep"})  # nothing changes
            for tags in (["bogus"], ["weights"], ["kv_cache"]):
                await queued_answered((level, tags), queued)
                await call("POST", "/wake_up", [("tags", t) for t in tags])
                await state(f"level {level} woke {tags}")
            seen.append((level, "queued", await queued))
        await call("POST", "/sleep", {"level": "0"})
        await call("POST", "/wake_up", [("tags", "scheduling")])
        await state("level 0 woke scheduling")
        await call("POST", "/pause", {"mode": "wait"})
        await call("POST", "/wake_up")  # awake already: it resumes the scheduler
        await state("paused, then woken")
        await call("POST", "/sleep", {"level": "1"})
        await call("POST", "/resume")  # the scheduler runs; the tags still sleep
        await state("asleep, then resumed")
        await call("POST", "/wake_up", [("tags", "weights"), ("tags", "kv_cache")])
        await state("woken")
    return seen


def test_simulator_pauses_sleeps_and_wakes_like_vllm(
    real: Target, sim: Target, tiny_model: TinyModel
) -> None:
    prompt = list(tiny_model.reference("A").prompts[0].token_ids)[:8]
    observed_real = asyncio.run(run_lifecycle(real, prompt))
    observed_sim = asyncio.run(run_lifecycle(sim, prompt))
    for i, (r, s) in enumerate(itertools.zip_longest(observed_real, observed_sim)):
        assert s == r, f"observation {i}:\n real {r}\n sim  {s}"
    finishes = {o[0]: o[2][1] for o in observed_real if len(o) == 5 and o[1] == "in flight"}
    assert finishes == {"abort": "abort", "wait": "length", "keep": "length"}
    # vLLM 0.32 queues what arrives while paused: the simulator's claim, held here
    held = [o[0] for o in observed_real if len(o) == 3 and o[1:] == ("queued answered", False)]
    assert held[:4] == ["abort", "wait", "keep", "paused wait"]
    assert ("aborted by the sleep", (200, "abort")) in observed_real


@dataclass(frozen=True)
class AdapterTarget:
    base_url: str
    admin_token: str
    api_key: str | None
    v1: Path  # two good adapters of rank 8
    v2: Path
    corrupt: Path  # v2 with a flipped byte after its manifest was written
    invalid: Path  # v1 whose adapter_config.json is no LoRA one (manifest rewritten)
    wide: Path  # v1 declaring rank 16 (above --max-lora-rank 8; manifest rewritten)
    root: Path  # the allowed root
    foreign: Path  # v1 with a tensor of a module the model lacks (AdapterModulesUnknown)
    misfit: Path  # v1 whose first lora_A has one input feature more (AdapterBaseMismatch)


def adapter_variants(good: Path, into: Path) -> tuple[Path, Path, Path, Path]:
    """(invalid, wide, foreign, misfit) made from a good adapter, each with a manifest of its
    own files."""
    from safetensors.numpy import load_file, save_file

    made = []
    for name, key, value in (("invalid", "peft_type", "PREFIX_TUNING"), ("wide", "r", 16)):
        d = into / name
        shutil.copytree(good, d)
        config = json.loads((d / contract.ADAPTER_CONFIG_FILE).read_text())
        (d / contract.ADAPTER_CONFIG_FILE).write_text(json.dumps({**config, key: value}))
        write_manifest(d)
        made.append(d)
    for name in ("foreign", "misfit"):
        d = into / name
        shutil.copytree(good, d)
        weights = d / "adapter_model.safetensors"
        with weights.open("rb") as f:  # the metadata the simulator reads its seed from
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        tensors = load_file(str(weights))
        first = sorted(k for k in tensors if k.endswith("lora_A.weight"))[0]
        if name == "foreign":
            tensors[first.replace("_proj.lora_A", "_projection.lora_A")] = tensors.pop(first)
        else:
            a = tensors[first]
            tensors[first] = np.concatenate([a, np.zeros((a.shape[0], 1), a.dtype)], axis=1)
        save_file(tensors, str(weights), metadata=header.get("__metadata__"))
        write_manifest(d)
        made.append(d)
    return made[0], made[1], made[2], made[3]


@pytest.fixture(scope="module")
def lora_server(tiny_model: TinyModel) -> Iterator[VllmServer]:
    """A LoRA-enabled server with the runtime routes, used only by the adapter comparisons."""
    with start_vllm_server(
        tiny_model,
        api_key="test-api-key",
        load_format="safetensors",
        model_dir=tiny_model.checkpoints["A"],
        extra_args=LORA_ARGS,
        env=LORA_ENV,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def real_lora(lora_server: VllmServer, tiny_model: TinyModel) -> Iterator[AdapterTarget]:
    adapters = ensure_tiny_adapters(tiny_model)
    work = Path(tempfile.mkdtemp(prefix="contract-adapters-", dir=tiny_model.allowed_root))
    try:
        invalid, wide, foreign, misfit = adapter_variants(adapters.dir("v1"), work)
        yield AdapterTarget(
            lora_server.base_url, lora_server.admin_token, lora_server.api_key,
            adapters.dir("v1"), adapters.dir("v2"), adapters.dir("corrupt"), invalid, wide,
            tiny_model.allowed_root, foreign, misfit,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def sim_lora(
    lora_server: VllmServer, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdapterTarget]:
    root = tmp_path_factory.mktemp("sim-adapters")
    v1, v2 = make_sim_adapter(root / "v1", "v1"), make_sim_adapter(root / "v2", "v2")
    corrupt = root / "corrupt"  # as testbed/tiny_adapter.py corrupts its v2
    shutil.copytree(v2, corrupt)
    weights = next(corrupt.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    invalid, wide, foreign, misfit = adapter_variants(v1, root)
    fleet = SimFleet(
        1,
        admin_token=lora_server.admin_token,
        api_key=lora_server.api_key,
        allowed_root=root,
        vocab=tiny_model.vocab_size,
        max_lora_rank=8,
        runtime_lora_updating=True,
    )
    try:
        yield AdapterTarget(
            fleet.pods[0].base_url, lora_server.admin_token, lora_server.api_key,
            v1, v2, corrupt, invalid, wide, root, foreign, misfit,
        )  # fmt: skip
    finally:
        fleet.close()


async def run_adapters(target: AdapterTarget, prompts: list[list[int]]) -> list[Any]:
    """vLLM's runtime LoRA routes behind the guard, completions through an adapter and the
    adapter check: statuses, bodies (an error's message with the model's name and paths
    replaced; a success's bare text exactly), the cards /v1/models lists, the client's
    outcomes. vLLM sends a load's or an unload's success text without a content type, which
    aiohttp cannot (it names application/octet-stream): the text is what is compared."""
    seen: list[Any] = []
    async with aiohttp.ClientSession() as http:
        anyone = WorkerClient(target.base_url, http=http, api_key=target.api_key)
        model = await anyone.model_name()

        def plain(text: str) -> str:
            return text.replace(model, "<model>")

        async def record(response: aiohttp.ClientResponse) -> Any:
            raw = await response.read()
            COMPARED.add((response.url.path, ""))
            try:
                doc = json.loads(raw)
            except ValueError:
                seen.append((response.url.path, response.status, "text", plain(raw.decode())))
                return None
            seen.append((response.url.path, response.status, shape(doc)))
            error = doc.get("error") if isinstance(doc, dict) else None
            if isinstance(error, dict):
                seen.append(("message", plain(str(error.get("message"))), error.get("type")))
            return doc

        async def route(path: str, body: Any, auth: str | None = target.admin_token) -> None:
            headers = {"Authorization": f"Bearer {auth}"} if auth else {}
            async with http.post(target.base_url + path, json=body, headers=headers) as r:
                await record(r)

        async def load(name: str, path: Path | str, **more: Any) -> None:
            await route(ADAPTER_ROUTES[0], {"lora_name": name, "lora_path": str(path), **more})

        async def unload(name: str) -> None:
            await route(ADAPTER_ROUTES[1], {"lora_name": name})

        async def cards() -> None:
            headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
            async with http.get(target.base_url + "/v1/models", headers=headers) as r:
                doc = await record(r)
            paths = {str(getattr(target, k)): k for k in ("v1", "v2", "corrupt")}
            seen.append(
                ("cards", [(plain(c["id"]), paths.get(c["root"], c["root"] and "<root>"),
                            c["parent"] and plain(c["parent"])) for c in doc["data"]])
            )  # fmt: skip

        async def outcome(call: Awaitable[Any]) -> None:
            try:
                result = await call
            except WorkerError as exc:
                seen.append(("error", exc.kind, exc.status, exc.code))
                return
            if isinstance(result, dict):  # the adapter check: keys and types, rank, targets
                seen.append(("ok", shape(result), result.get("rank"), result.get("targetModules")))
            elif isinstance(result, list) and result and isinstance(result[0], list):
                seen.append(("ok", "scores", [len(scores) for scores in result]))
            else:
                seen.append(("ok", result))

        admin = WorkerClient(
            target.base_url, http=http, admin_token=target.admin_token, api_key=target.api_key
        )
        info = await admin.refit_info()
        seen.append(("lora", info.max_lora_rank, info.runtime_lora_updating))
        await outcome(admin.adapter_check(str(target.v1)))
        await outcome(admin.adapter_check(str(target.corrupt)))  # ManifestMismatch
        await outcome(admin.adapter_check(str(target.invalid)))  # AdapterInvalid
        await outcome(admin.adapter_check(str(target.root / "absent")))  # CheckpointMissing
        await outcome(admin.adapter_check("/etc"))  # PathNotAllowed
        await outcome(admin.adapter_check(str(target.wide)))  # AdapterRankTooHigh
        await outcome(admin.adapter_check(str(target.foreign)))  # AdapterModulesUnknown
        await outcome(admin.adapter_check(str(target.misfit)))  # AdapterBaseMismatch
        await cards()  # the base model alone
        await load("policy", target.v1)
        await load("policy", target.v2)  # 400: loaded already
        await load("policy", target.v2, load_inplace=False)  # 400 too
        await load("policy", target.v2, load_inplace=True)  # its weights replaced
        await load("broken", target.corrupt)  # vLLM loads a flipped byte without a word
        await cards()
        await outcome(admin.adapters())
        await outcome(admin.score_prompts(prompts, model="policy"))  # one prompt per request
        await outcome(admin.score_prompts(prompts[:1], model="nobody"))  # 404
        async with http.post(
            target.base_url + "/v1/completions",
            json={"model": "nobody", "prompt": prompts[0], "max_tokens": 1},
            headers={"Authorization": f"Bearer {target.api_key}"} if target.api_key else {},
        ) as r:
            await record(r)
        await load("x", target.root / "absent")  # 404, no adapter there
        await load("x", target.wide)  # 500: rank 16 above --max-lora-rank 8
        await load(model, target.v1)  # 400: the base model's name
        await load("", target.v1)  # 400
        await route(ADAPTER_ROUTES[0], {"lora_name": "x"})  # 400: pydantic's
        await route(ADAPTER_ROUTES[1], {})  # 400: pydantic's
        await route(ADAPTER_ROUTES[0], {"lora_name": "x", "lora_path": str(target.v1)}, None)
        await route(ADAPTER_ROUTES[0], {"lora_name": "x", "lora_path": str(target.v1)},
                    target.api_key)  # fmt: skip
        await unload("broken")
        await unload("broken")  # 404
        await outcome(admin.unload_adapter("policy"))
        await outcome(admin.unload_adapter("policy"))  # False: vLLM's 404
        newer_token = (9 << 32) | 2
        newer = WorkerClient(
            target.base_url, http=http, admin_token=target.admin_token, fence=newer_token
        )
        older = WorkerClient(
            target.base_url, http=http, admin_token=target.admin_token, fence=newer_token - 1
        )
        await outcome(newer.unload_adapter("nothing-loaded"))  # admitted: the mark moves
        await outcome(older.load_adapter("intruder", str(target.v1)))  # 409 StaleFence
        await outcome(admin.adapters())
    return seen


async def run_without_lora(target: Target) -> list[Any]:
    """A pod without runtime LoRA updating: the routes do not exist (behind the guard)."""
    seen: list[Any] = []
    async with aiohttp.ClientSession() as http:
        admin = WorkerClient(
            target.base_url, http=http, admin_token=target.admin_token, api_key=target.api_key
        )
        info = await admin.refit_info()
        seen.append(("lora", info.max_lora_rank, info.runtime_lora_updating))
        for path in ADAPTER_ROUTES:
            body = {"lora_name": "x", "lora_path": str(target.good)}
            for auth in (target.admin_token, None):
                headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                async with http.post(target.base_url + path, json=body, headers=headers) as r:
                    seen.append((path, r.status, await r.json()))
                COMPARED.add((path, ""))
    return seen


def test_simulator_serves_lora_adapters_like_vllm(
    real: Target,
    sim: Target,
    real_lora: AdapterTarget,
    sim_lora: AdapterTarget,
    tiny_model: TinyModel,
) -> None:
    observed_real = asyncio.run(run_without_lora(real))
    observed_sim = asyncio.run(run_without_lora(sim))
    assert observed_sim == observed_real
    assert observed_real[0] == ("lora", 0, False)
    assert [o[1:] for o in observed_real[1:]] == [
        (404, {"detail": "Not Found"}),  # admitted by the guard, no such route in vLLM
        (401, {"error": "Unauthorized"}),
    ] * 2

    prompts = [list(p.token_ids) for p in ensure_tiny_adapters(tiny_model).reference("v1").prompts]
    observed_real = asyncio.run(run_adapters(real_lora, prompts[:2]))
    observed_sim = asyncio.run(run_adapters(sim_lora, prompts[:2]))
    for i, (r, s) in enumerate(itertools.zip_longest(observed_real, observed_sim)):
        assert s == r, (
            f"observation {i} (after {observed_real[max(0, i - 3) : i]}):\n real {r}\n sim  {s}"
        )
    assert observed_real[0] == ("lora", 8, True)
    texts = [o[3] for o in observed_real if len(o) == 4 and o[2] == "text"]
    assert texts == [
        "Success: LoRA adapter 'policy' added successfully.",
        "Success: LoRA adapter 'policy' added successfully.",
        "Success: LoRA adapter 'broken' added successfully.",
        "Success: LoRA adapter 'broken' removed successfully.",
    ]
    statuses = [o[1] for o in observed_real if o[0] in ADAPTER_ROUTES]
    # loads: new, twice a name loaded already, in place, the corrupt adapter; no adapter there,
    # rank 16, the base model's name, an empty name, no path; an unload without a name; loads
    # without the admin token (none, the API key); unloads: loaded, then not
    assert statuses == [200, 400, 400, 200, 200, 404, 500, 400, 400, 400, 400, 401, 401, 200, 404]
    messages = [o[1] for o in observed_real if o[0] == "message"]
    assert "Loading lora x failed: No adapter found for <path>" in messages
    assert "The model `nobody` does not exist. Valid aliases: <model>." in messages
    unloads = [o for o in observed_real if o[:2] == ("ok", True) or o[:2] == ("ok", False)]
    assert unloads == [("ok", True), ("ok", False), ("ok", False)]  # 404s tolerated
    rejected = [o[3] for o in observed_real if o[:2] == ("error", "rejected")]
    assert rejected == [
        "ManifestMismatch",
        "AdapterInvalid",
        "CheckpointMissing",
        "PathNotAllowed",
        "AdapterRankTooHigh",  # rank 16 above --max-lora-rank 8
        "AdapterModulesUnknown",  # a tensor of q_projection: no module of the model
        "AdapterBaseMismatch",  # lora_A one input feature wider than its module
        contract.STALE_FENCE,
    ]
    assert ("cards", [("<model>", "<root>", None), ("policy", "v2", "<model>"),
                      ("broken", "corrupt", "<model>")]) in observed_real  # fmt: skip


TRANSFER_MASTER = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
# The weight-transfer routes without a trainer (a round with one is tests/worker/
# test_broadcast.py's): the order vLLM holds them to, its body validation, the plugin
# engine's refusal of the trainer's own rank, and the guard on each.
TRANSFER_CALLS: list[tuple[str, Any]] = [
    ("/update_weights", {"update_info": {}}),  # before any start
    ("/finish_weight_update", {}),  # no start to finish
    ("/init_weight_transfer_engine", {"init_info": {**TRANSFER_MASTER, "rank_offset": 0}}),
    ("/init_weight_transfer_engine", {}),  # 400: no init_info
    ("/update_weights", {}),  # 400: no update_info
    ("/start_weight_update", {}),
    ("/start_weight_update", {}),  # one is active already
    ("/update_weights", {"update_info": {"manifest": "nonsense"}}),  # no engine joined
    ("/finish_weight_update", {}),  # the refused update ended it
    ("/start_weight_update", {}),
    ("/finish_weight_update", {}),
]


async def run_transfer_routes(target: Target) -> list[Any]:
    seen: list[Any] = []
    # A fresh connection per call: vLLM closes one after a worker method's 500.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        for path, body in TRANSFER_CALLS:
            for token in (target.admin_token, None):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with http.post(target.base_url + path, json=body, headers=headers) as r:
                    doc = await r.json()
                error = doc.get("error") if isinstance(doc, dict) else None
                said = error.get("message") if isinstance(error, dict) else doc
                seen.append((path, token is not None, r.status, said))
                COMPARED.add((path, ""))
    return seen


def test_simulator_answers_the_weight_transfer_routes_like_refit_gloo(
    real: Target, sim: Target
) -> None:
    observed_real = asyncio.run(run_transfer_routes(real))
    observed_sim = asyncio.run(run_transfer_routes(sim))
    for i, (r, s) in enumerate(itertools.zip_longest(observed_real, observed_sim)):
        assert s == r, f"call {i}:\n real {r}\n sim  {s}"
    statuses = [o[2] for o in observed_real if o[1]]
    assert statuses == [500, 500, 500, 400, 400, 200, 500, 500, 500, 200, 200], observed_real
    assert all(o[2] == 401 for o in observed_real if not o[1])  # the guard, every route


async def refused_rpcs_on_one_connection(target: Target) -> tuple[int, bool]:
    """Refused RPCs and admin calls in turn over a pool of one connection, as the operator
    sends them to a pod that reports CAP_ERRORS_KEEP_CONNECTION: (connections opened,
    whether it reports it)."""
    trace, opened = connection_counter()
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as http:
        c = WorkerClient(target.base_url, http=http, admin_token=target.admin_token,
                         api_key=target.api_key, keep_rpc_connections=True)  # fmt: skip
        reports = contract.CAP_ERRORS_KEEP_CONNECTION in (await c.refit_info()).capabilities
        for _ in range(3):
            with pytest.raises(WorkerError) as err:
                await c.preflight(str(target.root / "absent"))
            assert err.value.code == "CheckpointMissing"
            assert await c.is_paused() is False
    return len(opened), reports


def test_a_refused_rpc_leaves_the_connection_open(real: Target, sim: Target) -> None:
    """The admin guard answers a refused RPC itself (vLLM's error body, as the contract
    rejections above show), so uvicorn keeps the connection: the operator pools RPCs on it.
    The simulator does the same."""
    assert asyncio.run(refused_rpcs_on_one_connection(real)) == (1, True)
    assert asyncio.run(refused_rpcs_on_one_connection(sim)) == (1, True)


def test_every_route_the_simulator_serves_was_compared() -> None:
    """Last in the module: what the tests above sent to the real server covers every route
    and query parameter value the simulator serves; the rest is SIM_UNSHOWN's to say."""
    if not COMPARED:
        pytest.skip("run with the module's other tests")
    paths = {path for path, _ in COMPARED}
    assert set(HTTP_STEPS) <= paths, sorted(set(HTTP_STEPS) - paths)
    params = {p for _, p in COMPARED}
    wanted = {f"mode={m}" for m in PAUSE_MODES} | {f"level={n}" for n in range(3)}
    wanted |= {"tags=weights", "tags=kv_cache", "tags=scheduling"}
    assert wanted <= params, sorted(wanted - params)
    assert any(p.startswith("/no-such") for p in paths)  # FastAPI's 404
    assert SIM_UNSHOWN  # the claims no test compares are named, not silent
