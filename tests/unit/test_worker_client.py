"""WorkerClient against the simulated worker: every method, every fault, authentication."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from refit_operator.worker import WorkerClient, WorkerError
from refit_worker import contract

from tests.support.simworker import SIM_VOCAB, SimFleet, SimPod, make_sim_checkpoint

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
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def client(pod: SimPod, http: httpx.AsyncClient, **kwargs: Any) -> WorkerClient:
    kwargs = {"admin_token": ADMIN, "api_key": API_KEY, **kwargs}
    return WorkerClient(pod.base_url, http=http, **kwargs)


async def test_every_endpoint_of_a_fresh_pod(pod: SimPod, http: httpx.AsyncClient) -> None:
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
    pod: SimPod, http: httpx.AsyncClient, checkpoints: dict[str, Path]
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


async def test_another_checkpoint_scores_differently(
    pod: SimPod, http: httpx.AsyncClient, checkpoints: dict[str, Path]
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
    http: httpx.AsyncClient,
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
    pod: SimPod, http: httpx.AsyncClient, root: Path
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
    "completions": lambda c: c.score([1, 2, 3]),
    "models": lambda c: c.score([1, 2, 3]),
    "metrics": lambda c: c.requests_in_flight(),
}


@pytest.mark.parametrize("step", list(CALLS))
@pytest.mark.parametrize(
    ("fault", "kind"),
    [("error", "http"), ("hang", "timeout"), ("malformed", "protocol"), ("crash", "connect")],
)
async def test_every_fault_maps_to_its_error_kind(
    pod: SimPod, http: httpx.AsyncClient, step: str, fault: str, kind: str
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
    pod: SimPod, http: httpx.AsyncClient, checkpoints: dict[str, Path]
) -> None:
    pod.set_fault("refit_load", "error", code="LoadFailed", times=1)
    c = client(pod, http)
    with pytest.raises(WorkerError) as err:
        await c.load(str(checkpoints["A"]), "step-1")
    assert (err.value.kind, err.value.code) == ("rejected", "LoadFailed")
    assert (await c.load(str(checkpoints["A"]), "step-1"))["version"] == "step-1"


async def test_delay_within_the_timeout_answers(pod: SimPod, http: httpx.AsyncClient) -> None:
    pod.set_fault("pause", "delay", 0.2)
    c = client(pod, http, timeout=5.0)
    await c.pause("keep")
    with pytest.raises(WorkerError) as err:
        await c.pause("keep", timeout=0.05)  # the per-call timeout wins over the client's
    assert err.value.kind == "timeout"


async def test_wrong_version_and_refused_reset(pod: SimPod, http: httpx.AsyncClient) -> None:
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


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
async def test_non_finite_logprobs_are_kept(
    pod: SimPod, http: httpx.AsyncClient, value: str
) -> None:
    pod.set_fault("completions", "nan", value)
    scores = await client(pod, http).score([1, 2, 3])
    assert scores[0] is None
    assert all(repr(s) == repr(float(value)) for s in scores[1:])


async def test_garbage_drift_and_missing_logprobs(pod: SimPod, http: httpx.AsyncClient) -> None:
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


async def test_out_of_vocabulary_token_is_an_http_400(pod: SimPod, http: httpx.AsyncClient) -> None:
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
    pod: SimPod, http: httpx.AsyncClient, admin: str | None, key: str | None, call: Call, ok: bool
) -> None:
    c = WorkerClient(pod.base_url, http=http, admin_token=admin, api_key=key)
    if ok:
        await call(c)
        return
    with pytest.raises(WorkerError) as err:
        await call(c)
    assert (err.value.kind, err.value.status) == ("http", 401)
    assert await client(pod, http).is_paused() is False  # nothing changed


async def test_nothing_listening_is_a_connect_error(http: httpx.AsyncClient) -> None:
    with pytest.raises(WorkerError) as err:
        await WorkerClient("http://127.0.0.1:9", http=http).weight_version()
    assert err.value.kind == "connect"


async def test_a_full_connection_pool_is_a_connect_error(pod: SimPod) -> None:
    pod.set_fault("pause", "hang")
    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(limits=limits) as small:
        c = client(pod, small)
        hanging = asyncio.create_task(c.pause("wait", timeout=5))
        await asyncio.sleep(0.2)
        with pytest.raises(WorkerError) as err:
            await c.weight_version(timeout=0.2)
        assert err.value.kind == "connect"
        hanging.cancel()
    assert pod.calls() == ["pause"]  # the second call never reached the pod


async def test_a_call_right_after_a_rejection_is_not_hit_by_the_closed_connection(
    pod: SimPod, http: httpx.AsyncClient, root: Path
) -> None:
    # vLLM closes the connection after a refusing RPC (the simulator does too).
    c = client(pod, http)
    for _ in range(20):
        with pytest.raises(WorkerError) as err:
            await c.preflight(str(root / "absent"))
        assert err.value.code == "CheckpointMissing"
        assert await c.is_paused() is False
