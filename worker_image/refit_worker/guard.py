"""Admin guard: an ASGI middleware for vLLM's ``--middleware refit_worker.guard.AdminGuard``.

vLLM's ``--api-key`` covers only paths under /v1, /v2, /inference and /cohere; with
VLLM_SERVER_DEV_MODE=1 everything else that changes the engine (/collective_rpc calls any
worker method, /weight_checker can zero the weights, /sleep, /pause, ...) answers anyone who
reaches the port. This guard requires ``Authorization: Bearer <token>`` (the token read from
the file named by REFIT_ADMIN_TOKEN_FILE) on every path outside those prefixes, except the
probes a kubelet and Prometheus need. An unknown path is an admin path: deny by default.
vLLM's runtime LoRA routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) are admin
paths too although they sit under /v1: an admitted one goes on to vLLM with the API key (from
``--api-key`` or VLLM_API_KEY) in place of the admin token, or with no Authorization at all.

Fails closed: with no token file, an unreadable or an empty one, every admin path answers
401 and the reason is logged (never sent to the client).

Fencing (one driver per pod, refit_worker.fence): once the token check passes, a
state-changing admin request (any method but GET, HEAD and OPTIONS: in vLLM's admin API,
POST) that carries ``X-Refit-Fence`` is admitted only if its token is at least the highest
this pod has admitted; a lower one answers 409 with
``{"error": {"code": "StaleFence", "message": ...}}``, a malformed one 400. The mark lives
in this middleware, i.e. in the API-server process: a restarted container starts without
one. With several API-server processes (vLLM's ``--api-server-count`` > 1) each would keep
its own mark, so a fleet pod runs one.

Readiness (refit_worker.readiness): the guard also serves the pod's readiness probe,
``GET /refit/ready``, open like /health: 503 until a pass vouched for this process's weights
with ``POST /refit/ready`` (an admin call, fenced like the others), then 200. Same process
memory, same single API server.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from refit_worker import fence, readiness
from refit_worker.contract import (
    ADAPTER_PATHS,
    FENCE_HEADER,
    OPEN_METHODS,
    READY_PATH,
    needs_admin,
)

TOKEN_FILE_ENV = "REFIT_ADMIN_TOKEN_FILE"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("refit_worker.guard")


_FENCE_KEY = FENCE_HEADER.lower().encode("ascii")


def fence_values(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Every value of the fencing header in an ASGI header list (normally none or one)."""
    return [value for key, value in headers if key.lower() == _FENCE_KEY]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


GUARD_CLASS = "refit_worker.guard.AdminGuard"


def guard_configured(argv: list[str] | None = None) -> bool:
    """Whether this server runs the guard with a usable token. Asked from vLLM's engine
    process, which cannot see the API server's app: multiprocessing hands every child the
    parent's sys.argv, so the command line tells whether --middleware named the guard."""
    args = sys.argv if argv is None else argv
    named = any(
        a == f"--middleware={GUARD_CLASS}" or (a == "--middleware" and nxt == GUARD_CLASS)
        for a, nxt in zip(args, [*args[1:], ""], strict=True)
    )
    path = os.environ.get(TOKEN_FILE_ENV)
    if not named or not path:
        return False
    try:
        with open(path, "rb") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def configured_api_key(
    argv: list[str] | None = None, environ: dict[str, str] | None = None
) -> str | None:
    """vLLM's API key as its own middleware takes it (--api-key wins over VLLM_API_KEY; the
    first of several), read from this process's command line: what an admitted adapter route
    must carry past vLLM's --api-key check in place of the admin token."""
    args = sys.argv if argv is None else argv
    for a, nxt in zip(args, [*args[1:], ""], strict=True):
        if a.startswith("--api-key="):
            return a.split("=", 1)[1] or None
        if a == "--api-key" and nxt and not nxt.startswith("--"):
            return nxt
    env = os.environ if environ is None else environ
    return env.get("VLLM_API_KEY") or None


def with_api_key(
    headers: list[tuple[bytes, bytes]], api_key: str | None
) -> list[tuple[bytes, bytes]]:
    """The headers with the admin token replaced by vLLM's API key (or dropped without one):
    the admin token never reaches vLLM, and vLLM's own check still passes."""
    kept = [(k, v) for k, v in headers if k.lower() != b"authorization"]
    if api_key:
        kept.append((b"authorization", b"Bearer " + api_key.encode()))
    return kept


class TokenSource:
    """The admin token from a file, re-read when the file changes (a rotated Secret)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._token: bytes | None = None
        self._warned: str | None = None

    def get(self) -> bytes | None:
        if not self.path:
            self._fail(f"{TOKEN_FILE_ENV} is not set; admin endpoints are refused")
            return None
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
            if stamp != self._stamp:
                with open(self.path, "rb") as f:
                    self._token = f.read().strip() or None
                self._stamp = stamp
        except OSError as exc:
            self._stamp, self._token = None, None
            self._fail(f"admin token file unreadable ({exc}); admin endpoints are refused")
            return None
        if self._token is None:
            self._fail(f"admin token file {self.path} is empty; admin endpoints are refused")
            return None
        self._warned = None
        return self._token

    def _fail(self, why: str) -> None:
        if why != self._warned:  # log each distinct reason once, not per request
            log.error("refit admin guard: %s", why)
            self._warned = why
        return None


class AdminGuard:
    """ASGI middleware; vLLM instantiates it with ``app.add_middleware(AdminGuard)``."""

    def __init__(self, app: ASGIApp, token_file: str | None = None) -> None:
        self.app = app
        self.tokens = TokenSource(token_file or os.environ.get(TOKEN_FILE_ENV))
        self.tokens.get()  # log a misconfiguration at start, not at the first request
        # The highest fencing token this pod (this API-server process) has admitted.
        self.fences = fence.FenceTracker()
        # Whether a refit pass vouched for this process's weights (/refit/ready).
        self.ready_mark = readiness.ReadyMark()
        self.api_key = configured_api_key()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET") if scope["type"] == "http" else "GET"
        path = scope.get("path", "")
        if scope["type"] == "http" and path.rstrip("/") == READY_PATH and method in OPEN_METHODS:
            status, body = self.ready_mark.answer()
            await _respond(send, status, json.dumps(body).encode())
            return
        if not needs_admin(method, path):
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _respond(
                send, 401, b'{"error":"Unauthorized"}', [(b"www-authenticate", b"Bearer")]
            )
            return
        if scope["type"] == "http" and fence.is_fenced(method):
            refusal = self._fence(scope)
            if refusal is not None:
                status, body = refusal
                await _respond(send, status, json.dumps(body).encode())
                return
        if scope["type"] == "http" and method == "POST" and path.rstrip("/") == READY_PATH:
            status, body = await self._vouch(receive)  # the guard's own endpoint, not vLLM's
            await _respond(send, status, json.dumps(body).encode())
            return
        if path.rstrip("/") in ADAPTER_PATHS:
            scope = {
                **scope,
                "headers": with_api_key(list(scope.get("headers") or []), self.api_key),
            }
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _answering_errors(self.app, scope, receive, send)

    async def _vouch(self, receive: Receive) -> tuple[int, dict[str, Any]]:
        """An admitted ``POST /refit/ready``: a pass vouches for this process's weights."""
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return readiness.BAD_REQUEST_STATUS, readiness.vouch_error_body("no body")
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > 4096:
                return readiness.BAD_REQUEST_STATUS, readiness.vouch_error_body("body too long")
        try:
            version = readiness.parse_vouch(body)
        except readiness.VouchError as exc:
            return readiness.BAD_REQUEST_STATUS, readiness.vouch_error_body(str(exc))
        try:
            answer = self.ready_mark.vouch(version, readiness.vouched_process(body))
        except readiness.VouchRefused as exc:
            log.warning("refit: a vouch for weights %s refused: %s", version, exc)
            return readiness.PROCESS_CHANGED_STATUS, readiness.vouch_refused_body(str(exc))
        log.info("refit: a pass vouched for weights %s: ready", version)
        return 200, answer

    def _fence(self, scope: Scope) -> tuple[int, dict[str, Any]] | None:
        """None to admit an authorized state-changing request, else (status, JSON body)."""
        where = f"{scope.get('method')} {scope.get('path')}"
        try:
            token = fence.read_fence(fence_values(scope.get("headers") or []))
        except fence.FenceError as exc:
            log.warning("refit admin guard: %s refused: %s", where, exc)
            return fence.MALFORMED_FENCE_STATUS, fence.malformed_fence_body(str(exc))
        highest = self.fences.highest
        if self.fences.admit(token):
            return None
        assert token is not None and highest is not None  # admit() refuses nothing else
        log.warning(
            "refit admin guard: %s refused: %s",
            where,
            fence.stale_fence_message(token, highest),
        )
        return fence.STALE_FENCE_STATUS, fence.stale_fence_body(token, highest)

    def _authorized(self, scope: Scope) -> bool:
        expected = self.tokens.get()
        given = bearer_token(scope.get("headers") or [])
        if expected is None or given is None:
            return False
        return hmac.compare_digest(given, expected)


async def _answering_errors(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run an admitted admin request; if its handler raises before answering (a worker method
    that refused through /collective_rpc, a refused transfer route), answer with the error
    body vLLM's own handler of last resort would send, here. Left to that handler (Starlette's
    ServerErrorMiddleware, outside this middleware), the exception reaches uvicorn, which
    closes the connection after the answer: a client that pooled it meets the close on its
    next request. Answered here, the connection stays open (CAP_ERRORS_KEEP_CONNECTION)."""
    started = False

    async def tracked(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, tracked)
    except Exception as exc:
        if started:
            raise  # the answer is under way: nothing sound to send (uvicorn closes)
        log.exception("%s %s failed", scope.get("method"), scope.get("path"))
        status, body = _error_body(exc)
        await _respond(send, status, body)


def _error_body(exc: Exception) -> tuple[int, bytes]:
    """vLLM's answer to an exception no handler of its own claims (its ``exception_handler``
    for Exception): its ErrorResponse, with the status that names."""
    try:
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
    except ImportError:  # a vLLM without that module: the same shape, as vLLM 0.20 writes it
        doc = {"error": {"message": str(exc), "type": "InternalServerError", "param": None,
                         "code": 500}}  # fmt: skip
        return 500, json.dumps(doc).encode()
    err = create_error_response(exc)
    return int(err.error.code), json.dumps(err.model_dump()).encode()


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})
