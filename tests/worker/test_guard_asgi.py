"""refit_worker.guard as plain ASGI: routing policy, token checks, fail-closed (no vLLM)."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from refit_worker.guard import AdminGuard, Receive, Scope, Send, guard_configured, needs_admin


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
