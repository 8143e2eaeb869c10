"""vLLM's error answers, as the simulator sends them: its OpenAI-style error bodies, its
validation errors, and a failed RPC (whose connection uvicorn closes after the 500)."""

from __future__ import annotations

import asyncio
import contextvars
import re
from typing import Any

from aiohttp import web
from refit_worker import contract


def vllm_error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An error body shaped like vLLM's OpenAI-style error answers."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def sanitized(message: str) -> str:
    """A message as vLLM's error answers carry it: file paths replaced by ``<path>``
    (vllm/entrypoints/serve/exception_handling/utils.py, sanitize_message)."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message).strip()


def query_error(param: str, message: str) -> web.Response:
    """vLLM's 400 for a query parameter that fails validation (its RequestValidationError
    handler): the message is pydantic's, the param ``query.<name>``."""
    return vllm_error(400, f"1 validation error: {message}", "Bad Request", f"query.{param}")


def body_field_missing(key: str, body: Any) -> web.Response:
    """vLLM's 400 for a JSON body without a required field (its RequestValidationError
    handler, as for query parameters)."""
    given = f"<dict of {len(body)} items>" if isinstance(body, dict) else repr(body)
    detail = {"type": "missing", "loc": f"body.{key}", "msg": "Field required", "input": given}
    return vllm_error(400, f"1 validation error:\n  {detail}", "Bad Request", f"body.{key}")


def add_lora_failed(error: str) -> web.Response:
    """vLLM's 500 for an adapter its worker refused (the engine's add_lora raised)."""
    return vllm_error(
        500,
        f"Call to add_lora method failed: Worker failed with error '{error}', please check "
        "the stack trace above for the root cause",
        "InternalServerError",
    )


# Without the admin guard's own answer (a pod that does not report
# CAP_ERRORS_KEEP_CONNECTION), uvicorn logs the traceback of a failed RPC and then closes the
# connection; a request the client sent on it meanwhile is never answered. The simulator
# keeps that window open.
RPC_FAILURE_CLOSE_DELAY = 0.05
doomed: set[Any] = set()  # transports that answer nothing more (the server drops them)
# The pod the request in hand is for (the server's dispatch sets it for each request).
SERVING: contextvars.ContextVar[Any] = contextvars.ContextVar("serving", default=None)


def rpc_failure(request: web.Request, message: str) -> web.Response:
    """How vLLM answers a /collective_rpc whose worker method raised: the admin guard answers
    it with vLLM's error body and the connection stays open; without the guard the exception
    passes through the app, and uvicorn closes the connection after the 500."""
    pod = SERVING.get()
    keeps = pod is not None and contract.CAP_ERRORS_KEEP_CONNECTION in pod.reported_capabilities()
    transport = request.transport
    if transport is not None and not keeps:
        doomed.add(transport)

        def close() -> None:
            doomed.discard(transport)
            transport.close()

        asyncio.get_running_loop().call_later(RPC_FAILURE_CLOSE_DELAY, close)
    return vllm_error(
        500,
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause",
        "InternalServerError",
    )
