"""Clients of the pods never reuse a connection vLLM may be closing. vLLM's API server (uvicorn)
closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; a POST sent on a pooled
one at that moment is reset before any answer, and no client retries a POST (CI lost a
load-test request to it: ReadError('') with no status). The operator's session expires idle
connections after contract.CLIENT_KEEPALIVE_SECONDS, well before; so do the load generator,
the TRL integration and the tests' own client."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from refit_operator.edges.worker_client import WorkerClient, session
from refit_worker.contract import CLIENT_KEEPALIVE_SECONDS
from refit_worker.guard import Receive, Scope, Send

from testbed.vllm_server import free_port


async def peer_port(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers each request with the client's port: a new port is a new connection."""
    body = str(scope["client"][1]).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server() -> Iterator[str]:
    """uvicorn as vLLM runs it: its keep-alive timeout."""
    from vllm import envs

    port = free_port("127.0.0.1")
    config = uvicorn.Config(
        peer_port, host="127.0.0.1", port=port, log_level="warning",
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, lifespan="off",
    )  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_the_client_keepalive_is_well_under_vllms() -> None:
    from vllm import envs

    assert CLIENT_KEEPALIVE_SECONDS * 2 <= envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


def test_the_operator_reconnects_after_an_idle_pause_instead_of_reusing(server: str) -> None:
    async def ports() -> list[int]:
        async with session() as http:
            pod = WorkerClient(server, http=http)
            seen = []
            for pause in (0.0, 0.2, CLIENT_KEEPALIVE_SECONDS + 0.5):
                await asyncio.sleep(pause)
                seen.append(int((await pod._request("POST", "/pause", timeout=5)).text))
            return seen

    first, quick, after_idle = asyncio.run(ports())
    assert quick == first  # pooled: the test can tell a reused connection from a new one
    assert after_idle != first  # expired by the client, never offered to a closing server
