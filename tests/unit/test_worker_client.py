"""WorkerClient against the simulated worker: every method, every fault, authentication."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient, WorkerError
from refit_worker import contract

from testbed.simworker import SIM_VOCAB, make_sim_checkpoint
from testbed.simworker.fleet import SimFleet, SimPod
from tests.fixtures.loopback import connection_counter

ADMIN = "admin-secret"
API_KEY = "api-secret"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pods' allowed checkpoint root."""
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def fleet(root: Path) -> Iterator[SimFleet]:
    # One simulator for the module; each test takes pods no other test touched.
    fleet = SimFleet(160, admin_token=ADMIN, api_key=API_KEY, allowed_root=root)
    yield fleet
    fleet.close()


@pytest.fixture(scope="module")
def checkpoints(root: Path) -> dict[str, Path]:
    return {
        "A": make_sim_checkpoint(root / "A", "step-1"),
        "B": make_sim_checkpoint(root / "B", "step-2"),
    }


_free = iter(range(10**6))


@pytest.fixture
def pod(fleet: SimFleet) -> SimPod:
    """A pod no other test of this module has touched."""
    return fleet.pods[next(_free)]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with worker_client.session() as session:  # the operator's own session
        yield session


def client(pod: SimPod, http: aiohttp.ClientSession, **kwargs: Any) -> WorkerClient:
    kwargs = {"admin_token": ADMIN, "api_key": API_KEY, **kwargs}
    return WorkerClient(pod.base_url, http=http, **kwargs)


async def test_every_endpoint_of_a_fresh_pod(pod: SimPod, http: aiohttp.ClientSession) -> None:
    c = client(pod, http)
    info = await c.refit_info()
    assert info.weight_version == "default"
    assert set(contract.REQUIRED_CAPABILITIES) <= set(info.capabilities)
    assert await c.weight_version() == "default"
    assert await c.is_paused() is False
    await c.pause("wait")
    assert await c.is_paused() is True
    await c.sleep(1)
    assert await c.is_sleeping() is True
    assert await c.wake_up(["weights"]) is False
    assert await c.wake_up(["kv_cache"]) is True
    assert await c.is_sleeping() is False
    await c.reset_prefix_cache()
    await c.resume()
    await c.update_weight_version("v7")
    assert await c.weight_version() == "v7"
    assert await c.requests_in_flight() == 0
    pod.set_state(running=2, waiting=3)
    assert await c.requests_in_flight() == 5
    # Dummy weights score every token uniformly, as a real dummy-loaded vLLM does.
    assert await c.score([3, 4, 5]) == [None, -math.log(SIM_VOCAB), -math.log(SIM_VOCAB)]
    assert pod.calls() == [
        "refit_info",
        "weight_info",
        "is_paused",
        "pause",
        "is_paused",
        "sleep",
        "is_sleeping",
        "wake_up",
        "wake_up",
        "is_sleeping",
        "reset_prefix_cache",
        "resume",
        "update_weight_version",
        "weight_info",
        "metrics",
        "metrics",
        "models",
        "completions",
    ]
    log = pod.call_log()
    assert log[3]["params"] == {"mode": "wait"}
    assert log[7]["params"] == {"tags": "weights"}


async def test_refit_cycle_loads_and_scores_the_checkpoint(
    pod: SimPod, http: aiohttp.ClientSession, checkpoints: dict[str, Path]
) -> None:
    c = client(pod, http)
    path = str(checkpoints["A"])
    checked = await c.preflight(path)
    assert checked["path"] == path
    loaded = await c.load(path, "step-1")
    assert loaded["version"] == "step-1"
    assert (await c.refit_info()).weight_version == "step-1"
    reference = await c.probe_reference(path)
    on_disk = json.loads((checkpoints["A"] / contract.PROBE_FILE).read_text())
    assert reference == contract.ProbeReference.from_json_dict(on_disk)
    for prompt in reference.prompts:
        assert await c.score(list(prompt.token_ids)) == list(prompt.logprobs)
    # The positional RPC arguments are what the extension receives.
    rpc = [entry for entry in pod.call_log() if entry["step"] == "refit_load"]
    assert rpc[0]["body"]["args"] == [path, "step-1"]
    # The model name is asked once per client.
    assert pod.counts()["models"] == 1


async def test_score_prompts_scores_every_prompt_in_one_request(
    pod: SimPod, http: aiohttp.ClientSession, checkpoints: dict[str, Path]
) -> None:
    c = client(pod, http)
    path = str(checkpoints["A"])
    await c.load(path, "step-1")
    reference = await c.probe_reference(path)
    prompts = [list(p.token_ids) for p in reference.prompts]
    pod.calls(clear=True)
    scored = await c.score_prompts(prompts)
    assert scored == [list(p.logprobs) for p in reference.prompts]
    assert pod.calls() == ["models", "completions"]
    # The same prompt twice, and a one-token prompt (nothing to score but its entry 0).
    assert await c.score_prompts([prompts[1], [7], prompts[1]]) == [scored[1], [None], scored[1]]
    # A pod that runs LoRA (PassContext.lora): the same scores, one request per prompt.
    pod.calls(clear=True)
    assert await c.score_prompts(prompts, batch=False) == scored
    assert pod.calls().count("completions") == len(prompts) > 1


async def test_one_bad_prompt_fails_the_batch_and_no_prompts_is_refused(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    c = client(pod, http)
    with pytest.raises(WorkerError) as err:
        await c.score_prompts([[1, 2, 3], [4, SIM_VOCAB + 5], [6, 7]])
    assert (err.value.kind, err.value.status) == ("http", 400)
    assert "out of vocabulary" in err.value.message
    with pytest.raises(ValueError, match="no prompts"):
        await c.score_prompts([])
    assert pod.calls() == ["models", "completions"]  # the empty call sent nothing


async def test_another_checkpoint_scores_differently(
    pod: SimPod, http: aiohttp.ClientSession, checkpoints: dict[str, Path]
) -> None:
    c = client(pod, http)
    await c.load(str(checkpoints["B"]), "step-2")
    reference_a = await c.probe_reference(str(checkpoints["A"]))
    ids = list(reference_a.prompts[0].token_ids)
    assert await c.score(ids) != list(reference_a.prompts[0].logprobs)


def _break_manifest(directory: Path) -> None:
    (directory / contract.MANIFEST_FILE).write_text("{not json")


def _change_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda root: root / "absent", "CheckpointMissing"),
        (lambda root: Path("/etc"), "PathNotAllowed"),
        (lambda root: root / "A" / ".." / "A", "PathNotAllowed"),
        (lambda root: _damaged(root, "bad-manifest", _break_manifest), "ManifestInvalid"),
        (lambda root: _damaged(root, "changed", _change_weights), "ManifestMismatch"),
    ],
    ids=["missing", "outside-root", "dotdot", "manifest-invalid", "manifest-mismatch"],
)
async def test_preflight_and_load_refuse_with_the_contract_code(
    pod: SimPod,
    http: aiohttp.ClientSession,
    root: Path,
    make: Callable[[Path], Path],
    code: str,
    checkpoints: dict[str, Path],
) -> None:
    c = client(pod, http)
    path = str(make(root))
    for call in (c.preflight(path), c.load(path, "x")):
        with pytest.raises(WorkerError) as err:
            await call
        assert (err.value.kind, err.value.code, err.value.status) == ("rejected", code, 500)
        # The detail is the worker's own sentence, without vLLM's wrapper around it.
        assert "stack trace" not in err.value.message and err.value.message
    assert (await c.refit_info()).weight_version == "default"


def _damaged(root: Path, name: str, damage: Callable[[Path], None]) -> Path:
    directory = make_sim_checkpoint(root / name, name)
    damage(directory)
    return directory


async def test_probe_reference_missing_is_rejected(
    pod: SimPod, http: aiohttp.ClientSession, root: Path
) -> None:
    directory = make_sim_checkpoint(root / "no-probe", "np")
    (directory / contract.PROBE_FILE).unlink()
    with pytest.raises(WorkerError) as err:
        await client(pod, http).probe_reference(str(directory))
    assert (err.value.kind, err.value.code) == ("rejected", "ProbeReferenceInvalid")


Call = Callable[[WorkerClient], Awaitable[Any]]
CALLS: dict[str, Call] = {
    "refit_info": lambda c: c.refit_info(),
    "refit_preflight": lambda c: c.preflight("/nowhere"),
    "refit_load": lambda c: c.load("/nowhere", "v"),
    "refit_probe_reference": lambda c: c.probe_reference("/nowhere"),
    "pause": lambda c: c.pause("abort"),
    "resume": lambda c: c.resume(),
    "is_paused": lambda c: c.is_paused(),
    "sleep": lambda c: c.sleep(1),
    "wake_up": lambda c: c.wake_up(["weights"]),
    "is_sleeping": lambda c: c.is_sleeping(),
    "reset_prefix_cache": lambda c: c.reset_prefix_cache(),
    "update_weight_version": lambda c: c.update_weight_version("v"),
    "weight_info": lambda c: c.weight_version(),
    "refit_ready": lambda c: c.mark_ready("v"),
    "completions": lambda c: c.score_prompts([[1, 2, 3], [4, 5]]),
    "models": lambda c: c.score([1, 2, 3]),
    "metrics": lambda c: c.requests_in_flight(),
}


@pytest.mark.parametrize("step", list(CALLS))
@pytest.mark.parametrize(
    ("fault", "kind"),
    [("error", "http"), ("hang", "timeout"), ("malformed", "protocol"), ("crash", "connect")],
)
async def test_every_fault_maps_to_its_error_kind(
    pod: SimPod, http: aiohttp.ClientSession, step: str, fault: str, kind: str
) -> None:
    pod.set_fault(step, fault)
    with pytest.raises(WorkerError) as err:
        await CALLS[step](client(pod, http, timeout=0.3 if fault == "hang" else 10.0))
    assert err.value.kind == kind, err.value
    if fault == "error":
        assert err.value.status == 500
    if fault == "crash":
        # Down until restarted: refused, then a fresh pod at weight version "default".
        with pytest.raises(WorkerError) as again:
            await client(pod, http).weight_version()
        assert again.value.kind == "connect"
        pod.clear_faults()
        pod.restart()
        assert await client(pod, http).weight_version() == "default"


async def test_injected_rejection_code_reaches_the_caller(
    pod: SimPod, http: aiohttp.ClientSession, checkpoints: dict[str, Path]
) -> None:
    pod.set_fault("refit_load", "error", code="LoadFailed", times=1)
    c = client(pod, http)
    with pytest.raises(WorkerError) as err:
        await c.load(str(checkpoints["A"]), "step-1")
    assert (err.value.kind, err.value.code) == ("rejected", "LoadFailed")
    assert (await c.load(str(checkpoints["A"]), "step-1"))["version"] == "step-1"


async def test_delay_within_the_timeout_answers(pod: SimPod, http: aiohttp.ClientSession) -> None:
    pod.set_fault("pause", "delay", 0.2)
    c = client(pod, http, timeout=5.0)
    await c.pause("keep")
    with pytest.raises(WorkerError) as err:
        await c.pause("keep", timeout=0.05)  # the per-call timeout wins over the client's
    assert err.value.kind == "timeout"


async def test_wrong_version_and_refused_reset(pod: SimPod, http: aiohttp.ClientSession) -> None:
    c = client(pod, http)
    await c.update_weight_version("v2")
    pod.set_fault("weight_info", "wrong_version", "v1")
    pod.set_fault("refit_info", "wrong_version", "v0")
    assert await c.weight_version() == "v1"
    assert (await c.refit_info()).weight_version == "v0"
    pod.set_fault("reset_prefix_cache", "refuse")
    with pytest.raises(WorkerError) as err:
        await c.reset_prefix_cache()
    assert (err.value.kind, err.value.code) == ("rejected", None)


async def test_the_ready_step_vouches_and_skips_only_a_worker_without_the_endpoint(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """steps.mark_ready: a 404 is an older worker image (its readiness probe is not ours to
    open); any other failure is the step's, so the pass retries or fails closed."""
    from refit_operator.controller.steps import mark_ready

    c = client(pod, http)
    pod.set_fault("refit_ready", "error", 404, times=1)
    await mark_ready(c, "v3", 5.0)
    assert pod.state()["vouched"] is None
    pod.set_fault("refit_ready", "error", 503, times=1)
    with pytest.raises(WorkerError) as err:
        await mark_ready(c, "v3", 5.0)
    assert err.value.status == 503 and pod.state()["vouched"] is None
    await mark_ready(c, "v3", 5.0)
    assert pod.state()["vouched"] == "v3"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
async def test_non_finite_logprobs_are_kept(
    pod: SimPod, http: aiohttp.ClientSession, value: str
) -> None:
    pod.set_fault("completions", "nan", value)
    scores = await client(pod, http).score([1, 2, 3])
    assert scores[0] is None
    assert all(repr(s) == repr(float(value)) for s in scores[1:])


async def test_garbage_drift_and_missing_logprobs(pod: SimPod, http: aiohttp.ClientSession) -> None:
    c = client(pod, http)
    ids = list(range(2, 60))
    uniform = -math.log(SIM_VOCAB)
    pod.set_fault("completions", "drift", 0.25)
    assert await c.score(ids) == [None] + [pytest.approx(uniform + 0.25)] * (len(ids) - 1)
    pod.set_fault("completions", "garbage")
    garbage = [s for s in await c.score(ids) if s is not None]
    assert len(garbage) == len(ids) - 1 and max(garbage) > 0  # impossible logprobs
    pod.set_fault("completions", "missing")
    assert await c.score(ids) == [None] * len(ids)


async def test_out_of_vocabulary_token_is_an_http_400(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(WorkerError) as err:
        await client(pod, http).score([1, SIM_VOCAB + 5])
    assert (err.value.kind, err.value.status) == ("http", 400)


@pytest.mark.parametrize(
    ("admin", "key", "call", "ok"),
    [
        (None, API_KEY, lambda c: c.pause("wait"), False),
        ("wrong", API_KEY, lambda c: c.refit_info(), False),
        (ADMIN, API_KEY, lambda c: c.refit_info(), True),
        (ADMIN, None, lambda c: c.score([1, 2]), False),
        (ADMIN, "wrong", lambda c: c.score([1, 2]), False),
        (None, None, lambda c: c.requests_in_flight(), True),
    ],
    ids=["no-admin", "wrong-admin", "admin", "no-key", "wrong-key", "metrics-open"],
)
async def test_authentication(
    pod: SimPod,
    http: aiohttp.ClientSession,
    admin: str | None,
    key: str | None,
    call: Call,
    ok: bool,
) -> None:
    c = WorkerClient(pod.base_url, http=http, admin_token=admin, api_key=key)
    if ok:
        await call(c)
        return
    with pytest.raises(WorkerError) as err:
        await call(c)
    assert (err.value.kind, err.value.status) == ("http", 401)
    assert await client(pod, http).is_paused() is False  # nothing changed


async def test_the_admin_token_goes_only_where_the_guard_requires_it(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """The token travels in clear to the pod's IP: the open reads (a drain's /metrics, the
    readiness probe's GET /refit/ready, /health) never carry it; every admin call, reads
    of admin paths included, does; /v1 carries vLLM's API key instead."""
    c = client(pod, http, fence=7)
    pod.call_log(clear=True)
    await c.requests_in_flight()
    await c._request("GET", "/health", timeout=5.0)
    with pytest.raises(WorkerError):  # 503: not vouched yet
        await c._request("GET", contract.READY_PATH, timeout=5.0)
    await c.refit_info()
    await c.weight_version()
    await c.score([1, 2])
    await c.pause("wait")
    await c.mark_ready("default")
    sent = [(x["step"], x["auth"]) for x in pod.call_log()]
    assert sent == [
        ("metrics", False), ("health", False), ("refit_ready", False),
        (contract.RPC_INFO, True), ("weight_info", True), ("models", True),
        ("completions", True), ("pause", True), ("refit_ready", True),
    ], sent  # fmt: skip
    assert [x["status"] for x in pod.call_log()] == [200, 200, 503] + [200] * 6


async def test_nothing_listening_is_a_connect_error(http: aiohttp.ClientSession) -> None:
    with pytest.raises(WorkerError) as err:
        await WorkerClient("http://127.0.0.1:9", http=http).weight_version()
    assert err.value.kind == "connect"
    assert err.value.message.startswith("GET /weight_info: cannot connect: "), err.value.message


async def test_a_full_connection_pool_is_a_connect_error(
    pod: SimPod, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Waiting for a pooled connection is part of connecting: it is bounded by the connect
    # budget, shrunk here so that it runs out well before the call's own timeout.
    monkeypatch.setattr(worker_client, "CONNECT_TIMEOUT_SECONDS", 0.1)
    pod.set_fault("pause", "hang")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as small:
        c = client(pod, small)
        hanging = asyncio.create_task(c.pause("wait", timeout=5))
        try:
            await asyncio.sleep(0.2)
            with pytest.raises(WorkerError) as err:
                await c.weight_version(timeout=2)
            assert err.value.kind == "connect", err.value
        finally:
            hanging.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hanging
    assert pod.calls() == ["pause"]  # the second call never reached the pod


@pytest.mark.parametrize("keeps", [False, True], ids=["closes", "keeps"])
async def test_a_call_right_after_a_rejection_is_not_hit_by_the_closed_connection(
    pod: SimPod, root: Path, keeps: bool
) -> None:
    """Without the guard's own answer, vLLM closes the connection after a refusing RPC (the
    simulator does too: a pod that does not report CAP_ERRORS_KEEP_CONNECTION), and the
    client gives each RPC a connection of its own. A pod that reports it keeps the
    connection, and the client pools RPCs with the rest: one connection for all."""
    if not keeps:
        pod.set_state(capabilities=list(contract.REQUIRED_CAPABILITIES))
    trace, opened = connection_counter()
    async with worker_client.session([trace]) as http:
        c = client(pod, http, keep_rpc_connections=keeps)
        for _ in range(20):
            with pytest.raises(WorkerError) as err:
                await c.preflight(str(root / "absent"))
            assert err.value.code == "CheckpointMissing"
            assert await c.is_paused() is False
    assert len(opened) == (1 if keeps else 21), len(opened)


async def test_consecutive_requests_to_a_pod_reuse_one_connection(pod: SimPod) -> None:
    """A pass's requests, and the next pass's within the keep-alive, share one pooled
    connection; an RPC gets one of its own unless the pod keeps a refused RPC's connection
    open (keep_rpc_connections)."""
    trace, opened = connection_counter()
    async with worker_client.session([trace]) as http:
        c = client(pod, http)
        for _ in range(2):  # two passes' worth
            await c.world_size()
            await c.pause("keep")
            assert await c.is_paused() is True
            await c.resume()
            await c.weight_version()
            await c.requests_in_flight()
        assert len(opened) == 1
        await c.refit_info()
        await c.world_size()
        assert len(opened) == 2
        kept = client(pod, http, keep_rpc_connections=True)
        assert contract.CAP_ERRORS_KEEP_CONNECTION in (await kept.refit_info()).capabilities
        await kept.world_size()
        await kept.refit_info()
        assert len(opened) == 2


# --- transport failures against raw loopback sockets ------------------------------------
# A raw asyncio server misbehaves at the socket level in ways no HTTP framework will: each
# behaviour gets the connection after the request head was read.
Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # answer nothing until the client hangs up


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # SO_LINGER 0: the close sends RST, as a killed process's kernel does.
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    writer.transport.abort()


async def _half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + b'{"weight_version"')
    await writer.drain()
    writer.close()


async def _half_answer_then_silent(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(HEAD + b'{"weight_version"')
    await writer.drain()
    await reader.read()


async def _not_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b"<html>502 Bad Gateway</html>"
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await reader.read()


@contextlib.asynccontextmanager
async def raw_server(behave: Behaviour) -> AsyncIterator[str]:
    """A loopback TCP server that reads each request head, then behaves; yields its URL."""
    heads: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await behave(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()
    assert heads and all(h.startswith(b"GET /weight_info ") for h in heads)  # it was reached


@pytest.mark.parametrize(
    ("behave", "kind", "message"),
    [
        (_silent, "timeout", "no answer in time (0.3s)"),
        (_half_answer_then_silent, "timeout", "no answer in time (0.3s)"),
        (_close, "connect", "connection lost: ServerDisconnectedError"),
        (_reset, "connect", "connection lost: ClientOSError(104"),
        (_half_answer, "connect", "transport failed: ClientPayloadError"),
        (_not_json, "protocol", "answer is not JSON: '<html>502 Bad Gateway</html>'"),
    ],
    ids=["silent", "half-answer-then-silent", "close", "reset", "half-answer", "not-json"],
)
async def test_a_misbehaving_socket_maps_to_its_error_kind(
    http: aiohttp.ClientSession, behave: Behaviour, kind: str, message: str
) -> None:
    # Only the silent sockets need the short timeout; the others get time to misbehave on
    # loaded cores (the server shares this event loop), so a slow reset is not a timeout.
    timeout = 0.3 if kind == "timeout" else 10.0
    async with raw_server(behave) as url:
        with pytest.raises(WorkerError) as err:
            await WorkerClient(url, http=http, timeout=timeout).weight_version()
    assert err.value.kind == kind, err.value
    assert err.value.message.startswith(f"GET /weight_info: {message}"), err.value.message


# --- fencing: one driver per pod ------------------------------------------------------
STATE_CHANGING = {
    "refit_info",
    "refit_preflight",
    "refit_load",
    "refit_probe_reference",
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "reset_prefix_cache",
    "update_weight_version",
    "refit_ready",  # the vouch is a POST
}


@pytest.mark.parametrize("step", list(CALLS))
async def test_the_fence_goes_on_every_request_outside_v1(
    pod: SimPod, http: aiohttp.ClientSession, step: str
) -> None:
    token = (3 << 32) | 17
    with contextlib.suppress(WorkerError):  # the RPCs on /nowhere are refused: no matter
        await CALLS[step](client(pod, http, fence=token))
    log = pod.call_log()
    assert log, "the call reached the pod"
    for entry in log:
        api = entry["step"] in ("models", "completions")
        assert entry["fence"] == (None if api else token), entry
    # State-changing calls raise the pod's mark; reads do not.
    assert pod.state()["fence"] == (token if step in STATE_CHANGING else None)


async def test_no_fence_sends_no_header(pod: SimPod, http: aiohttp.ClientSession) -> None:
    c = client(pod, http)
    await c.pause("wait")
    await c.refit_info()
    assert [e["fence"] for e in pod.call_log()] == [None, None]
    assert pod.state()["fence"] is None


@pytest.mark.parametrize("bad", [-1, 2**64, True, 1.5, "7"])
def test_an_invalid_fence_is_refused_at_construction(bad: Any) -> None:
    with pytest.raises(ValueError, match="fencing token"):
        WorkerClient("http://127.0.0.1:9", http=None, fence=bad)  # type: ignore[arg-type]


class LeaseLost(Exception):
    pass


@pytest.mark.parametrize("step", list(CALLS))
async def test_before_call_raising_stops_the_request_unchanged(
    pod: SimPod, http: aiohttp.ClientSession, step: str
) -> None:
    lost = LeaseLost("lease may have expired")

    def check() -> None:
        raise lost

    with pytest.raises(LeaseLost) as err:
        await CALLS[step](client(pod, http, fence=5, before_call=check))
    assert err.value is lost  # not wrapped in WorkerError
    assert pod.call_log() == []  # nothing reached the pod
    assert pod.state()["fence"] is None


async def test_before_call_runs_before_every_request(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    seen: list[int] = []

    def check() -> None:
        seen.append(len(pod.call_log()))  # how many calls the pod had served by then

    c = client(pod, http, fence=1, before_call=check)
    await c.resume()
    await c.is_paused()
    await c.score([1, 2, 3])  # two requests: /v1/models, then /v1/completions
    await c.score([1, 2])  # the model name is cached: one request
    assert seen == [0, 1, 2, 3, 4]
    assert pod.calls() == ["resume", "is_paused", "models", "completions", "completions"]


async def test_before_call_stops_a_caller_midway(pod: SimPod, http: aiohttp.ClientSession) -> None:
    allowed = [True, True, False]

    def check() -> None:
        if not allowed.pop(0):
            raise LeaseLost("stop")

    c = client(pod, http, fence=2, before_call=check)
    await c.pause("wait")
    await c.sleep(1)
    with pytest.raises(LeaseLost):
        await c.wake_up()
    assert pod.calls() == ["pause", "sleep"]


STALE_CALLS: dict[str, Call] = {
    step: CALLS[step]
    for step in (
        "refit_info",
        "refit_preflight",
        "refit_load",
        "pause",
        "resume",
        "sleep",
        "wake_up",
        "reset_prefix_cache",
        "update_weight_version",
    )
}


@pytest.mark.parametrize("step", list(STALE_CALLS))
async def test_a_stale_fence_is_a_stalefence_rejection(
    pod: SimPod, http: aiohttp.ClientSession, step: str
) -> None:
    newer = client(pod, http, fence=(2 << 32) | 1)
    older = client(pod, http, fence=(1 << 32) | 9)
    await newer.pause("wait")
    with pytest.raises(WorkerError) as err:
        await STALE_CALLS[step](older)
    assert (err.value.kind, err.value.status, err.value.code) == ("rejected", 409, "StaleFence")
    assert err.value.message == (
        f"fencing token {(1 << 32) | 9} is older than {(2 << 32) | 1}, the newest this pod has "
        "seen: another refit pass owns this pod"
    )
    assert pod.state()["paused"] is True  # the stale pass changed nothing
    assert pod.call_log()[-1]["status"] == 409
    # Reads are not fenced: the stale pass can still look.
    assert await older.is_paused() is True
    # The pass that owns the pod carries on.
    await newer.resume()


async def test_a_409_without_the_stalefence_code_is_an_http_error(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    pod.set_fault("pause", "error", 409)
    with pytest.raises(WorkerError) as err:
        await client(pod, http, fence=1).pause("wait")
    assert (err.value.kind, err.value.status, err.value.code) == ("http", 409, None)


async def test_a_malformed_fence_answer_is_an_http_400(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    # The client never sends one (the constructor checks); a proxy or a person might.
    async with http.post(
        pod.base_url + "/pause",
        headers={"Authorization": f"Bearer {ADMIN}", contract.FENCE_HEADER: "abc"},
    ) as r:
        assert r.status == 400
        assert "not a non-negative integer" in (await r.json())["error"]["message"]
    assert pod.state()["paused"] is False
