"""cluster.connect resolves the environment's proxy once, and its session does not consult
the environment per request (the per-request netrc and proxy lookups ran in threads and cost
a 10,000-pod refit more CPU than its requests: bench/results/HISTORY.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from refit_operator.edges import cluster

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://10.1.2.3:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def _connect(tmp_path: Path) -> tuple[str | None, bool]:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)

    async def go() -> tuple[str | None, bool]:
        api = await cluster.connect(str(path))
        try:
            return api.configuration.proxy, api.rest_client.pool_manager.trust_env
        finally:
            await api.close()

    return asyncio.run(go())


def test_env_proxy_is_resolved_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    proxy, trust_env = _connect(tmp_path)
    assert proxy == "http://proxy.example:3128"
    assert trust_env is False


def test_no_proxy_excludes_the_api_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "10.1.2.3")
    proxy, trust_env = _connect(tmp_path)
    assert proxy is None
    assert trust_env is False


def test_no_proxy_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert _connect(tmp_path) == (None, False)
