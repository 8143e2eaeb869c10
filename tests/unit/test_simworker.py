"""The simulated worker itself: addresses, control API, model semantics, fault lifetimes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient, WorkerError
from refit_worker import contract, fence

from testbed.simworker import (
    SIM_VOCAB,
    make_sim_adapter,
    make_sim_checkpoint,
    sim_logprobs,
)
from testbed.simworker.fleet import SimFleet, SimPod, loopback_ips

Fleet = Callable[..., list[SimPod]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with worker_client.session() as session:
        yield session


def test_loopback_ips_skip_network_and_broadcast_parts() -> None:
    ips = loopback_ips(300, "127.9.0.250")
    assert ips[:5] == ["127.9.0.250", "127.9.0.251", "127.9.0.252", "127.9.0.253", "127.9.0.254"]
    assert ips[5] == "127.9.1.1"
    assert len(set(ips)) == 300
    with pytest.raises(ValueError, match="loopback"):
        loopback_ips(3, "127.255.255.253")


async def test_every_pod_has_its_own_address_and_state(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    pods = sim_fleet(5)
    others = sim_fleet(2)
    assert len({p.ip for p in pods + others}) == 7  # fleets of one test never share addresses
    assert len({p.port for p in pods}) == 1
    assert pods[2].base_url == f"http://{pods[2].ip}:{pods[2].port}"
    await WorkerClient(pods[2].base_url, http=http).update_weight_version("v9")
    versions = [await WorkerClient(p.base_url, http=http).weight_version() for p in pods]
    assert versions == ["default", "default", "v9", "default", "default"]
    assert pods[2].calls() == ["update_weight_version", "weight_info"]
    assert pods[0].calls() == ["weight_info"]
    assert pods[2].calls(clear=True) and pods[2].calls() == []


async def test_fault_fires_the_given_number_of_times(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1)
    pod.set_fault("weight_info", "error", 503, times=2)
    c = WorkerClient(pod.base_url, http=http)
    for _ in range(2):
        with pytest.raises(WorkerError) as err:
            await c.weight_version()
        assert err.value.status == 503
    assert await c.weight_version() == "default"
    assert pod.state()["faults"] == {}
    assert [e["status"] for e in pod.call_log()] == [503, 503, 200]


@pytest.mark.parametrize(
    ("step", "kind", "code"),
    [
        ("no_such_step", "error", None),
        ("weight_info", "nan", None),
        ("pause", "error", "LoadFailed"),
        ("refit_load", "error", "NoSuchCode"),
    ],
)
def test_control_refuses_bad_faults(
    sim_fleet: Fleet, step: str, kind: str, code: str | None
) -> None:
    (pod,) = sim_fleet(1)
    with pytest.raises(ValueError, match="simworker control fault"):
        pod.set_fault(step, kind, code=code)
    assert pod.state()["faults"] == {}
    with pytest.raises(ValueError, match="cannot set"):
        pod.set_state(up=False)


async def test_crash_drops_kept_alive_connections_and_restarts_fresh(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path)
    c = WorkerClient(pod.base_url, http=http)
    await c.load(str(make_sim_checkpoint(tmp_path / "a", "a")), "a")
    await c.update_weight_version("a")  # the connection is now kept alive
    pod.crash(restart_after=0.5)
    assert pod.state()["up"] is False
    with pytest.raises(WorkerError) as err:
        await c.weight_version()
    assert err.value.kind == "connect"
    for _ in range(100):
        await asyncio.sleep(0.05)
        if pod.state()["up"]:
            break
    # A restarted pod is a fresh vLLM: default version, dummy weights.
    assert await c.weight_version() == "default"
    assert (await c.refit_info()).weight_version == "default"
    assert await c.score([1, 2]) == [None, -math.log(SIM_VOCAB)]


async def test_completions_wait_while_paused_or_asleep(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1)
    c = WorkerClient(pod.base_url, http=http)
    await c.pause("keep")
    with pytest.raises(WorkerError) as err:
        await c.score([1, 2], timeout=0.3)
    assert err.value.kind == "timeout"
    await c.resume()
    await c.sleep(0)
    queued = asyncio.create_task(c.score([1, 2], timeout=10))
    await asyncio.sleep(0.2)
    assert not queued.done()
    assert await c.wake_up(["scheduling"]) is True
    assert await queued == [None, -math.log(SIM_VOCAB)]


async def test_sleep_level_2_discards_weights_until_the_next_load(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path)
    ckpt = make_sim_checkpoint(tmp_path / "a", "a")
    c = WorkerClient(pod.base_url, http=http)
    await c.load(str(ckpt), "a")
    ids = list((await c.probe_reference(str(ckpt))).prompts[0].token_ids)
    expected = sim_logprobs("a", ids)
    await c.sleep(1)
    await c.wake_up()
    assert await c.score(ids) == expected  # level 1 keeps the weights
    await c.sleep(2)
    await c.wake_up()
    assert await c.score(ids) != expected
    assert pod.state()["weights_discarded"] is True
    await c.load(str(ckpt), "a")
    assert await c.score(ids) == expected


async def test_checkpoint_drift_shows_in_the_scores(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path)
    ckpt = make_sim_checkpoint(tmp_path / "d", "d", drift=-0.125)
    c = WorkerClient(pod.base_url, http=http)
    await c.load(str(ckpt), "d")
    prompt = (await c.probe_reference(str(ckpt))).prompts[1]
    scores = await c.score(list(prompt.token_ids))
    diffs = {
        round(s - r, 9)
        for s, r in zip(scores[1:], prompt.logprobs[1:], strict=True)
        if s is not None and r is not None
    }
    assert diffs == {-0.125}


async def test_load_of_a_foreign_directory_is_refused(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path / "root")
    (tmp_path / "root").mkdir()
    ckpt = make_sim_checkpoint(tmp_path / "elsewhere", "e")
    with pytest.raises(WorkerError) as err:
        await WorkerClient(pod.base_url, http=http).load(str(ckpt), "e")
    assert err.value.code == "PathNotAllowed"
    assert pod.state()["dummy"] is True


async def test_unknown_rpc_method_answers_like_vllm(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1)
    body = {"method": "no_such_method", "args": []}
    async with http.post(f"{pod.base_url}/collective_rpc", json=body) as response:
        assert response.status == 500
        doc = await response.json()
    assert "has no attribute 'no_such_method'" in doc["error"]["message"]


async def test_capabilities_can_be_withheld(sim_fleet: Fleet, http: aiohttp.ClientSession) -> None:
    (pod,) = sim_fleet(1)
    pod.set_state(capabilities=["verified-reload"], unsafe_reasons=["full cudagraphs + fp8"])
    info = await WorkerClient(pod.base_url, http=http).refit_info()
    assert info.capabilities == ("verified-reload",)
    assert info.unsafe_reasons == ("full cudagraphs + fp8",)


async def test_close_stops_the_process_and_every_address(http: aiohttp.ClientSession) -> None:
    fleet = SimFleet(3)
    pod = fleet.pods[1]
    assert await WorkerClient(pod.base_url, http=http).weight_version() == "default"
    fleet.close()
    assert fleet.proc.poll() is not None
    with pytest.raises(WorkerError) as err:
        await WorkerClient(pod.base_url, http=http).weight_version()
    assert err.value.kind == "connect"


async def test_a_list_of_prompts_is_scored_in_one_request_like_vllm(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path)
    ckpt = make_sim_checkpoint(tmp_path / "a", "a")
    c = WorkerClient(pod.base_url, http=http)
    await c.load(str(ckpt), "a")
    prompts = [list(p.token_ids) for p in (await c.probe_reference(str(ckpt))).prompts]
    prompts.append(prompts[0][:5])
    body = {"model": await c.model_name(), "prompt": prompts, "prompt_logprobs": 0, "max_tokens": 1}
    async with http.post(f"{pod.base_url}/v1/completions", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    assert [ch["index"] for ch in answer["choices"]] == list(range(len(prompts)))
    for choice, ids in zip(answer["choices"], prompts, strict=True):
        assert choice["prompt_token_ids"] == ids
        entries = zip(choice["prompt_logprobs"], ids, strict=True)
        got = [e and e[str(t)]["logprob"] for e, t in entries]
        assert got == sim_logprobs("a", ids)
    total = sum(len(ids) for ids in prompts)
    assert answer["usage"] == {
        "prompt_tokens": total,
        "completion_tokens": len(prompts),
        "total_tokens": total + len(prompts),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert pod.counts()["completions"] == 1


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([[1, 2], [3, SIM_VOCAB]], f"Token id {SIM_VOCAB} is out of vocabulary"),
        ([[1, 2], []], "The decoder prompt cannot be empty"),
        ([], "You must pass at least one prompt"),
    ],
    ids=["oov-in-one", "empty-prompt", "no-prompts"],
)
async def test_a_bad_prompt_in_a_list_fails_the_whole_request_like_vllm(
    sim_fleet: Fleet, http: aiohttp.ClientSession, prompt: list[list[int]], message: str
) -> None:
    (pod,) = sim_fleet(1)
    body = {"model": await WorkerClient(pod.base_url, http=http).model_name(), "prompt": prompt}
    async with http.post(f"{pod.base_url}/v1/completions", json=body) as response:
        assert response.status == 400
        doc = await response.json()
    assert doc["error"] == {
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


# --- fencing: the admin guard's rules, with refit_worker.fence ---------------------------
async def test_fencing_follows_the_guard_rules_and_logs_each_token(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    pods = sim_fleet(2, admin_token="t")
    pod = pods[0]
    old = WorkerClient(pod.base_url, http=http, admin_token="t", fence=4)
    new = WorkerClient(pod.base_url, http=http, admin_token="t", fence=9)
    anyone = WorkerClient(pod.base_url, http=http, admin_token="t")
    await old.pause("wait")  # admitted: the first token
    await new.resume()  # admitted: higher, and now the mark
    await new.pause("wait")  # admitted: equal
    with pytest.raises(WorkerError) as err:
        await old.resume()  # refused: lower
    assert (err.value.kind, err.value.status, err.value.code) == ("rejected", 409, "StaleFence")
    assert err.value.message == fence.stale_fence_message(4, 9)
    assert await old.is_paused() is True  # reads are not fenced; the refused resume did nothing
    await anyone.resume()  # no header: admitted, the mark stays
    assert [(e["step"], e["fence"], e["status"]) for e in pod.call_log()] == [
        ("pause", 4, 200),
        ("resume", 9, 200),
        ("pause", 9, 200),
        ("resume", 4, 409),
        ("is_paused", 4, 200),
        ("resume", None, 200),
    ]
    assert pod.state()["fence"] == 9
    assert pods[1].state()["fence"] is None  # every pod has its own mark
    await WorkerClient(pods[1].base_url, http=http, admin_token="t", fence=1).pause("wait")


async def test_a_stale_call_gets_the_guards_exact_answer(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1, admin_token="t")
    headers = {"Authorization": "Bearer t", contract.FENCE_HEADER: "12"}
    async with http.post(pod.base_url + "/pause", headers=headers) as r:
        assert r.status == 200
    for path, body in [("/sleep", None), ("/collective_rpc", {"method": "refit_info"})]:
        headers[contract.FENCE_HEADER] = "11"
        async with http.post(pod.base_url + path, headers=headers, json=body) as r:
            assert r.status == 409
            assert await r.json() == fence.stale_fence_body(11, 12)
    headers[contract.FENCE_HEADER] = "-1"
    async with http.post(pod.base_url + "/sleep", headers=headers) as r:
        assert r.status == 400
        negative = "X-Refit-Fence header '-1' is negative"
        assert await r.json() == fence.malformed_fence_body(negative)
    assert pod.call_log()[-1]["fence"] == "-1"  # the raw text of a malformed header
    assert pod.state()["asleep"] == []
    assert pod.state()["fence"] == 12


async def test_a_refused_call_consumes_no_fault(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1)
    await WorkerClient(pod.base_url, http=http, fence=5).pause("wait")
    pod.set_fault("resume", "error", 503, times=1)
    with pytest.raises(WorkerError) as err:
        await WorkerClient(pod.base_url, http=http, fence=3).resume()
    assert err.value.code == "StaleFence"  # fenced before any endpoint or fault
    assert pod.state()["faults"]["resume"]["times"] == 1
    with pytest.raises(WorkerError) as err:
        await WorkerClient(pod.base_url, http=http, fence=5).resume()
    assert err.value.status == 503


async def test_unauthorized_calls_do_not_move_the_mark(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1, admin_token="t")
    with pytest.raises(WorkerError) as err:
        await WorkerClient(pod.base_url, http=http, fence=100).pause("wait")
    assert err.value.status == 401
    assert pod.state()["fence"] is None
    assert pod.call_log()[0]["fence"] == 100
    await WorkerClient(pod.base_url, http=http, admin_token="t", fence=1).pause("wait")


async def test_crash_and_restart_forget_the_mark(
    sim_fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    (pod,) = sim_fleet(1)
    await WorkerClient(pod.base_url, http=http, fence=50).pause("wait")
    assert pod.state()["fence"] == 50
    pod.crash()
    assert pod.state()["fence"] is None
    pod.restart()
    # A fresh process admits any token: the pod lost its weights too, so whoever drives it
    # next starts over. (A new session: the crash reset the kept-alive connection.)
    async with worker_client.session() as fresh:
        await WorkerClient(pod.base_url, http=fresh, fence=2).pause("wait")
    assert pod.state()["fence"] == 2


async def test_lora_adapters_serve_their_own_scores_until_a_restart(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (pod,) = sim_fleet(1, allowed_root=tmp_path, admin_token="t", max_lora_rank=8,
                       runtime_lora_updating=True)  # fmt: skip
    v1 = make_sim_adapter(tmp_path / "v1", "v1")
    v2 = make_sim_adapter(tmp_path / "v2", "v2", drift=0.5)
    big = make_sim_adapter(tmp_path / "big", "big", rank=16)
    c = WorkerClient(pod.base_url, http=http, admin_token="t", fence=5)
    info = await c.refit_info()
    assert (info.max_lora_rank, info.runtime_lora_updating) == (8, True)
    check = await c.adapter_check(str(v1))
    assert (check["rank"], check["targetModules"]) == (8, ["q_proj", "v_proj"])
    await c.load_adapter("policy", str(v1))
    reference = await c.probe_reference(str(v1))
    ids = [list(p.token_ids) for p in reference.prompts]
    assert await c.score_prompts(ids, model="policy") == [
        list(p.logprobs) for p in reference.prompts
    ]
    assert await c.score(ids[0]) == [None] + [-math.log(SIM_VOCAB)] * (len(ids[0]) - 1)  # base
    with pytest.raises(WorkerError) as err:
        await c.load_adapter("policy", str(v2))  # loaded already: vLLM's 400
    assert err.value.status == 400
    await c.load_adapter("policy", str(v2), inplace=True)
    drifted = await c.score_prompts([ids[0]], model="policy")
    assert drifted[0][1:] == [lp + 0.5 for lp in sim_logprobs("v2", ids[0])[1:] if lp is not None]
    with pytest.raises(WorkerError) as err:
        await c.load_adapter("wide", str(big))  # rank 16 > --max-lora-rank 8
    assert err.value.status == 500
    assert await c.adapters() == ["policy"]
    assert pod.state()["adapters"] == {"policy": str(v2)}
    with pytest.raises(WorkerError) as err:  # an older pass is fenced on the adapter routes
        await WorkerClient(pod.base_url, http=http, admin_token="t", fence=4).unload_adapter(
            "policy"
        )
    assert err.value.code == contract.STALE_FENCE
    pod.crash()
    pod.restart()
    assert await c.adapters() == []  # a restart forgets the adapters
    assert await c.unload_adapter("policy") is False  # vLLM's 404
    pod.set_state(runtime_lora_updating=False)
    async with http.post(
        pod.base_url + "/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(v1)},
        headers={"Authorization": "Bearer t"},
    ) as r:
        assert (r.status, await r.json()) == (404, {"detail": "Not Found"})  # no such route
    async with http.post(
        pod.base_url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(v1)}
    ) as r:
        assert r.status == 401  # an admin path, though under /v1


async def test_a_drafter_is_refitted_with_its_target_and_drafts_as_measured(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The simulated drafter holds to what tests/worker/test_drafter.py measures on real vLLM:
    refit_info names it; a checkpoint without drafter/ is refused DrafterMissing by preflight,
    stage and load with both models untouched; a load reloads the drafter from drafter/, and
    the target accepts all the greedy drafts of a drafter trained with it and at most 0.6 of
    one's on other weights (there 0.32-0.46). Without a drafter /metrics has no counters."""
    (pod,) = sim_fleet(1, allowed_root=tmp_path, admin_token="t")
    c = WorkerClient(pod.base_url, http=http, admin_token="t")
    prompts = [[3, 4, 5, 6]]
    with pytest.raises(WorkerError) as err:
        await c.draft_acceptance(prompts)
    assert err.value.kind == "protocol"  # no spec-decode counters: no drafter
    pod.set_state(drafter="draft_model")
    assert (await c.refit_info()).drafter == "draft_model"
    assert await c.draft_acceptance(prompts) == (31.0, 31.0)  # as started: fresh
    a = make_sim_checkpoint(tmp_path / "A", "A", drafter="A")
    missing = make_sim_checkpoint(tmp_path / "B-no-drafter", "B")
    stale = make_sim_checkpoint(tmp_path / "B-drafter-A", "B", drafter="A")
    b = make_sim_checkpoint(tmp_path / "B", "B", drafter="B")
    await c.load(str(a), "A")
    for call in (c.preflight(str(missing)), c.stage(str(missing)), c.load(str(missing), "B")):
        with pytest.raises(WorkerError) as err:
            await call
        assert err.value.code == "DrafterMissing" and contract.DRAFTER_DIR in err.value.message
    assert pod.state()["loaded_version"] == "A"
    drafted, accepted = await c.draft_acceptance(prompts)
    assert drafted > 0 and accepted / drafted == 1.0  # untouched: A's drafter on A
    await c.stage(str(b))
    await c.load(str(b), "B")
    drafted, accepted = await c.draft_acceptance(prompts)
    assert accepted / drafted == 1.0
    await c.load(str(stale), "B")
    drafted, accepted = await c.draft_acceptance(prompts)
    assert 0 < accepted / drafted <= 0.6  # B's target beside A's drafter
    pod.crash()
    pod.restart()
    assert await c.draft_acceptance(prompts) == (31.0, 31.0)  # started fresh, counters too
