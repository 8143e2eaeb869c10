"""refit_worker.guard as plain ASGI: routing policy, token checks, fail-closed (no vLLM)."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from refit_worker.guard import (
    AdminGuard,
    Receive,
    Scope,
    Send,
    configured_api_key,
    guard_configured,
    needs_admin,
)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"inner"})


def client(token_file: Path | None) -> httpx.AsyncClient:
    guard = AdminGuard(app, token_file=str(token_file) if token_file else None)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t")


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    return f


ADMIN = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/abort_requests"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
    ("POST", "/weight_checker"),
    ("GET", "/server_info"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/update_weights"),
    # vLLM's runtime LoRA routes sit under /v1 but change what the pod serves.
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/something_new"),
    ("GET", "/docs"),
    ("POST", "/health"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN)
def test_policy_admin_paths(method: str, path: str) -> None:
    assert needs_admin(method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("HEAD", "/health"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", "/v2/x"),
        ("GET", "/ping"),
    ],
)
def test_policy_open_or_api_key_paths(method: str, path: str) -> None:
    assert not needs_admin(method, path)


@pytest.mark.parametrize(("method", "path"), ADMIN)
async def test_admin_paths_need_the_right_token(token_file: Path, method: str, path: str) -> None:
    async with client(token_file) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = await c.request(method, path, headers=headers)
            assert r.status_code == 401
            assert r.json() == {"error": "Unauthorized"}
        r = await c.request(method, path, headers={"Authorization": "Bearer s3cret"})
        assert (r.status_code, r.text) == (200, "inner")


async def test_open_paths_pass_without_a_token(token_file: Path) -> None:
    async with client(token_file) as c:
        for path in ("/health", "/metrics", "/v1/completions"):
            assert (await c.get(path)).status_code == 200


@pytest.mark.parametrize("content", [None, "", "  \n"])
async def test_fails_closed_without_a_usable_token(
    tmp_path: Path, content: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    with caplog.at_level(logging.ERROR, logger="refit_worker.guard"):
        async with client(f) as c:
            for token in ("", " ", "None"):
                r = await c.post("/collective_rpc", headers={"Authorization": f"Bearer {token}"})
                assert r.status_code == 401
            assert (await c.get("/health")).status_code == 200
    assert "admin endpoints are refused" in caplog.text


async def test_no_token_file_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REFIT_ADMIN_TOKEN_FILE", raising=False)
    async with client(None) as c:
        assert (await c.post("/sleep")).status_code == 401


async def test_token_rotation_is_picked_up(token_file: Path) -> None:
    async with client(token_file) as c:
        ok = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/sleep", headers=ok)).status_code == 200
        token_file.write_text("rotated-token")  # noqa: ASYNC240 (a test, not a server)
        assert (await c.post("/sleep", headers=ok)).status_code == 401
        new = {"Authorization": "Bearer rotated-token"}
        assert (await c.post("/sleep", headers=new)).status_code == 200


def test_guard_configured(token_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_ADMIN_TOKEN_FILE", str(token_file))
    argv = ["x", "--middleware", "refit_worker.guard.AdminGuard"]
    assert guard_configured(argv)
    assert guard_configured(["x", "--middleware=refit_worker.guard.AdminGuard"])
    assert not guard_configured(["x", "--middleware", "other.Middleware"])
    token_file.write_text("")
    assert not guard_configured(argv)
    monkeypatch.delenv("REFIT_ADMIN_TOKEN_FILE")
    assert not guard_configured(argv)


# --- fencing: one driver per pod ------------------------------------------------------
AUTH = {"Authorization": "Bearer s3cret"}


class Recorder:
    """An inner app that records which requests reached it (past the guard)."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached.append((scope["method"], scope["path"]))
        await app(scope, receive, send)


@pytest.fixture
def fenced(token_file: Path) -> tuple[AdminGuard, Recorder, httpx.AsyncClient]:
    inner = Recorder()
    guard = AdminGuard(inner, token_file=str(token_file))
    c = httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t")
    return guard, inner, c


def fenced_headers(token: object) -> dict[str, str]:
    return {**AUTH, "X-Refit-Fence": str(token)}


def stale(token: int, highest: int) -> dict[str, object]:
    return {
        "error": {
            "code": "StaleFence",
            "message": f"fencing token {token} is older than {highest}, the newest this pod "
            "has seen: another refit pass owns this pod",
        }
    }


FENCED_POSTS = [
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
]


@pytest.mark.parametrize("path", FENCED_POSTS)
async def test_stale_token_is_refused_with_409_and_reaches_nothing(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient], path: str
) -> None:
    guard, inner, c = fenced
    async with c:
        assert (await c.post("/pause", headers=fenced_headers(7))).status_code == 200
        inner.reached.clear()
        r = await c.post(path, headers=fenced_headers(6))
        assert r.status_code == 409
        assert r.headers["content-type"] == "application/json"
        assert r.json() == stale(6, 7)
    assert inner.reached == []  # vLLM never saw it
    assert guard.fences.highest == 7  # a refusal leaves the mark where it was


async def test_equal_and_higher_tokens_are_admitted_and_raise_the_mark(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient],
) -> None:
    guard, inner, c = fenced
    async with c:
        for token, highest in [(3, 3), (3, 3), (4, 4), (4, 4), (2**40, 2**40)]:
            r = await c.post("/sleep", headers=fenced_headers(token))
            assert (r.status_code, r.text) == (200, "inner")
            assert guard.fences.highest == highest
        r = await c.post("/sleep", headers=fenced_headers(4))
        assert r.status_code == 409
        assert r.json() == stale(4, 2**40)
    assert len(inner.reached) == 5


async def test_absent_header_is_admitted_and_leaves_the_mark(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient],
) -> None:
    guard, inner, c = fenced
    async with c:
        assert (await c.post("/pause", headers=AUTH)).status_code == 200
        assert guard.fences.highest is None
        assert (await c.post("/pause", headers=fenced_headers(10))).status_code == 200
        # A person with the admin token and curl is not fenced, and moves nothing.
        assert (await c.post("/resume", headers=AUTH)).status_code == 200
        assert guard.fences.highest == 10
        assert (await c.post("/resume", headers=fenced_headers(9))).status_code == 409
    assert inner.reached == [("POST", "/pause"), ("POST", "/pause"), ("POST", "/resume")]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("abc", "is not a non-negative integer"),
        ("-3", "is negative"),
        ("1" * 64, "at most 20 digits"),
        ("", "is empty"),
        (str(2**64), "above the largest fencing token"),
    ],
)
async def test_malformed_header_is_a_400_that_names_the_problem(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient], value: str, says: str
) -> None:
    guard, inner, c = fenced
    async with c:
        assert (await c.post("/pause", headers=fenced_headers(5))).status_code == 200
        r = await c.post("/sleep", headers={**AUTH, "X-Refit-Fence": value})
        assert r.status_code == 400
        error = r.json()["error"]
        assert says in error["message"] and "X-Refit-Fence" in error["message"]
        assert error["param"] == "X-Refit-Fence"
    assert inner.reached == [("POST", "/pause")]
    assert guard.fences.highest == 5


async def test_header_given_twice_is_a_400(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient],
) -> None:
    guard, inner, c = fenced
    async with c:
        headers = [("Authorization", "Bearer s3cret"), ("X-Refit-Fence", "9")]
        headers.append(("x-refit-fence", "1"))
        r = await c.post("/sleep", headers=headers)
        assert r.status_code == 400
        assert "given 2 times" in r.json()["error"]["message"]
    assert inner.reached == [] and guard.fences.highest is None


async def test_reads_are_not_refused_and_do_not_move_the_mark(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient],
) -> None:
    guard, inner, c = fenced
    async with c:
        assert (await c.post("/pause", headers=fenced_headers(8))).status_code == 200
        for path in ("/is_paused", "/is_sleeping", "/weight_info", "/server_info"):
            for value in ("1", "100", "garbage"):
                r = await c.get(path, headers={**AUTH, "X-Refit-Fence": value})
                assert (r.status_code, r.text) == (200, "inner"), (path, value)
        assert (await c.get("/metrics", headers={"X-Refit-Fence": "1"})).status_code == 200
        assert guard.fences.highest == 8  # a higher token on a read did not raise it
        assert (await c.post("/resume", headers=fenced_headers(8))).status_code == 200
    assert len(inner.reached) == 1 + 4 * 3 + 1 + 1


async def test_unauthorized_calls_never_touch_the_mark(
    fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient],
) -> None:
    guard, inner, c = fenced
    async with c:
        r = await c.post("/pause", headers={"X-Refit-Fence": "100"})
        assert r.status_code == 401  # the token check comes first
        r = await c.post("/pause", headers={"Authorization": "Bearer no", "X-Refit-Fence": "x"})
        assert r.status_code == 401
        assert guard.fences.highest is None
        assert (await c.post("/pause", headers=fenced_headers(1))).status_code == 200
    assert inner.reached == [("POST", "/pause")]


async def test_v1_is_not_fenced(fenced: tuple[AdminGuard, Recorder, httpx.AsyncClient]) -> None:
    guard, inner, c = fenced
    async with c:
        assert (await c.post("/pause", headers=fenced_headers(8))).status_code == 200
        r = await c.post("/v1/completions", headers={"X-Refit-Fence": "1"})
        assert r.status_code == 200  # vLLM's --api-key territory, not the guard's
    assert guard.fences.highest == 8
    assert inner.reached == [("POST", "/pause"), ("POST", "/v1/completions")]


async def test_each_guard_has_its_own_mark(token_file: Path) -> None:
    async with client(token_file) as a, client(token_file) as b:
        assert (await a.post("/pause", headers=fenced_headers(50))).status_code == 200
        assert (await b.post("/pause", headers=fenced_headers(1))).status_code == 200
        assert (await a.post("/pause", headers=fenced_headers(1))).status_code == 409


async def test_adapter_routes_reach_vllm_with_the_api_key_not_the_admin_token(
    token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(list(scope["headers"]))
        await app(scope, receive, send)

    for api_key, expected in (("k3y", [b"Bearer k3y"]), (None, [])):
        monkeypatch.setattr("sys.argv", ["vllm", *(["--api-key", api_key] if api_key else [])])
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        guard = AdminGuard(inner, token_file=str(token_file))
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/load_lora_adapter", json={}, headers={"X-Refit-Fence": "7"})
            assert r.status_code == 401  # no admin token: never reaches vLLM
            r = await c.post(
                "/v1/load_lora_adapter",
                json={},
                headers={"Authorization": "Bearer s3cret", "X-Refit-Fence": "7"},
            )
            assert r.status_code == 200
            r = await c.post(
                "/v1/unload_lora_adapter",
                json={},
                headers={"Authorization": "Bearer s3cret", "X-Refit-Fence": "6"},
            )
            assert r.status_code == 409  # fenced like every admin write
        auth = [v for k, v in seen.pop() if k.lower() == b"authorization"]
        assert auth == expected and not seen


def test_configured_api_key_reads_vllms_flag_then_its_env() -> None:
    assert configured_api_key(["x", "--api-key", "a"], {"VLLM_API_KEY": "e"}) == "a"
    assert configured_api_key(["x", "--api-key=b"], {}) == "b"
    assert configured_api_key(["x"], {"VLLM_API_KEY": "e"}) == "e"
    assert configured_api_key(["x"], {}) is None


async def raising(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("Call to collective_rpc method failed: RefitRejected: no")


async def raising_late(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("mid-answer")


async def test_an_admin_request_whose_handler_raises_is_answered_by_the_guard(
    token_file: Path,
) -> None:
    """vLLM's error body for an exception no handler of its own claims, answered here rather
    than by Starlette's ServerErrorMiddleware: the exception never reaches uvicorn, which
    would close the connection after the answer (CAP_ERRORS_KEEP_CONNECTION). An answer
    already under way cannot be replaced: that exception goes on. An open path is not the
    guard's to answer."""
    auth = {"Authorization": "Bearer s3cret"}
    guard = AdminGuard(raising, token_file=str(token_file))
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/collective_rpc", json={"method": "x"}, headers=auth)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["message"] == "Call to collective_rpc method failed: RefitRejected: no"
        assert (error["type"], error["code"]) == ("InternalServerError", 500)
        with pytest.raises(RuntimeError, match="collective_rpc"):
            await c.get("/health")
    late = AdminGuard(raising_late, token_file=str(token_file))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=late), base_url="http://t") as c:
        with pytest.raises(RuntimeError, match="mid-answer"):
            await c.post("/collective_rpc", json={}, headers=auth)
