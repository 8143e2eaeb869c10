"""/refit/ready as the admin guard serves it: GET answers 503 until a pass vouched for this
process's weights with an authorized, admitted POST, then 200; nothing else makes a pod
ready (plain ASGI, no vLLM)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from refit_worker.contract import READY_PATH
from refit_worker.guard import AdminGuard, Receive, Scope, Send
from refit_worker.readiness import (
    ReadyMark,
    VouchError,
    VouchRefused,
    parse_vouch,
    vouched_process,
)

AUTH = {"Authorization": "Bearer s3cret"}


class FakeVllm:
    """vLLM behind the guard: records what reached it, answers 200."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"success": true}'})


Pod = tuple[AdminGuard, FakeVllm, httpx.AsyncClient]


@pytest.fixture
def pod(tmp_path: Path) -> Pod:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    vllm = FakeVllm()
    guard = AdminGuard(vllm, token_file=str(token))
    c = httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t")
    return guard, vllm, c


def vouch(c: httpx.AsyncClient, version: str, **headers: str):
    return c.post(READY_PATH, json={"version": version}, headers={**AUTH, **headers})


async def test_not_ready_until_a_pass_vouches_then_ready_with_the_version(pod: Pod) -> None:
    _, vllm, c = pod
    async with c:
        before = await c.get(READY_PATH)  # no credentials: the kubelet has none
        assert before.status_code == 503
        assert before.json()["reason"] == "NotVouched"
        r = await vouch(c, "v7", **{"X-Refit-Fence": "3"})
        assert r.status_code == 200 and r.json()["version"] == "v7"
        after = await c.get(READY_PATH)
        assert after.status_code == 200
        assert after.json()["ready"] is True and after.json()["version"] == "v7"
        assert (await c.head(READY_PATH)).status_code == 200
        assert (await c.get(READY_PATH + "/")).status_code == 200
    assert vllm.reached == []  # the guard's own endpoint: vLLM sees none of it


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),  # anyone who reaches the port
        ({"Authorization": "Bearer wrong"}, 401),
        ({**AUTH, "X-Refit-Fence": "2"}, 409),  # a pass older than the one that owns the pod
        ({**AUTH, "X-Refit-Fence": "x"}, 400),  # malformed
    ],
)
async def test_a_refused_vouch_does_not_make_the_pod_ready(
    pod: Pod, headers: dict[str, str], status: int
) -> None:
    guard, vllm, c = pod
    async with c:
        guard.fences.admit(5)
        r = await c.post(READY_PATH, json={"version": "v"}, headers=headers)
        assert r.status_code == status
        assert (await c.get(READY_PATH)).status_code == 503
    assert vllm.reached == []


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "must be JSON"),
        (b"[1]", "must name the probed weights"),
        (b'{"version": ""}', "must name the probed weights"),
        (b'{"version": 3}', "must name the probed weights"),
        (b'{"version": "' + b"v" * 300 + b'"}', "at most 256"),
    ],
)
async def test_a_malformed_vouch_is_a_400_and_changes_nothing(
    pod: Pod, body: bytes, says: str
) -> None:
    _, _, c = pod
    async with c:
        r = await c.post(READY_PATH, content=body, headers=AUTH)
        assert r.status_code == 400
        assert says in r.json()["error"]["message"]
        assert (await c.get(READY_PATH)).status_code == 503


async def test_the_weight_stamp_and_other_admin_calls_do_not_make_the_pod_ready(pod: Pod) -> None:
    """Stamped and loaded is not probed: only the vouch after the probe counts."""
    _, vllm, c = pod
    async with c:
        for path in ("/update_weight_version", "/sleep", "/wake_up", "/collective_rpc"):
            r = await c.post(path, json={"new_version": "v1"}, headers=AUTH)
            assert r.status_code == 200
        assert (await c.get(READY_PATH)).status_code == 503
    assert len(vllm.reached) == 4


async def test_other_methods_on_the_path_are_admin_calls_for_vllm(pod: Pod) -> None:
    _, vllm, c = pod
    async with c:
        assert (await c.put(READY_PATH)).status_code == 401
        assert (await c.put(READY_PATH, headers=AUTH)).status_code == 200  # vLLM's to answer
        assert (await c.get(READY_PATH)).status_code == 503
    assert vllm.reached == [READY_PATH]


async def test_a_new_guard_is_a_new_process_without_the_mark(pod: Pod) -> None:
    guard, vllm, c = pod
    async with c:
        await vouch(c, "v1")
        assert (await c.get(READY_PATH)).status_code == 200
    restarted = AdminGuard(vllm, token_file=guard.tokens.path)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=restarted), base_url="http://t"
    ) as c2:
        assert (await c2.get(READY_PATH)).status_code == 503


async def test_a_vouch_bound_to_another_process_is_refused_and_changes_nothing(pod: Pod) -> None:
    """The container restarted between the pass's probe and its vouch: the new process is not
    the one probed (its boot weights were never probed), so it refuses and stays unready."""
    guard, vllm, c = pod
    async with c:
        probed = (await c.get(READY_PATH)).json()["process"]
        assert probed == guard.ready_mark.process
        guard.ready_mark.reset()  # as a restart: another process
        r = await c.post(READY_PATH, json={"version": "v1", "process": probed}, headers=AUTH)
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "ProcessChanged"
        assert (await c.get(READY_PATH)).status_code == 503
        now = (await c.get(READY_PATH)).json()["process"]
        assert now != probed
        r = await c.post(READY_PATH, json={"version": "v1", "process": now}, headers=AUTH)
        assert r.status_code == 200 and r.json()["process"] == now
        assert (await c.get(READY_PATH)).status_code == 200
    assert vllm.reached == []


def test_ready_mark_and_parse() -> None:
    mark = ReadyMark()
    assert not mark.ready and mark.answer()[0] == 503
    assert mark.answer()[1]["process"] == mark.process
    assert mark.vouch("b")["version"] == "b"
    assert mark.ready and mark.answer() == (
        200,
        {"ready": True, "version": "b", "vouchedAt": mark.at, "process": mark.process},
    )
    with pytest.raises(VouchRefused):
        mark.vouch("c", "another-process")
    assert mark.version == "b"
    assert mark.vouch("c", mark.process)["version"] == "c"
    before = mark.process
    mark.reset()
    assert not mark.ready and mark.process != before
    assert vouched_process(b'{"version": "v9", "process": "p1"}') == "p1"
    assert vouched_process(b'{"version": "v9"}') is None
    assert parse_vouch(b'{"version": "v9", "extra": 1}') == "v9"
    with pytest.raises(VouchError):
        parse_vouch(b"null")
