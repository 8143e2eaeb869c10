"""Async HTTP client for ONE vLLM pod running the refit_worker plugin.

Every call is one HTTP request; nothing here retries (the operator's per-pod flow owns
retries and backoff). This module is the transport: the request, its credentials, fencing
header and time limits, and what a failed one means; worker_answers.py reads what the pod
answered (pure). Every failure surfaces as :class:`WorkerError` (defined there, imported from
here) whose ``kind`` tells the caller what it may assume:

- ``connect``: no answer came back because the connection failed or dropped (refused,
  unreachable, not established within ``CONNECT_TIMEOUT_SECONDS``, reset mid-request: a
  crashed pod). A refused or timed-out connect never reached the pod.
- ``timeout``: the pod accepted the request but did not answer in time; the step may still
  be running there.
- ``http``: the pod answered with a non-2xx status (``status`` holds it).
- ``rejected``: the pod refused on purpose. From ``/collective_rpc`` this is the worker
  extension's ``RefitRejected`` (``code`` holds the contract code); ``code`` is None for a
  refusal without one (``/reset_prefix_cache`` answering ``success: false``). From any
  path, ``code`` ``StaleFence`` (HTTP 409): the call's fencing token is older than one the
  pod has already seen, so a newer pass owns the pod and this caller must stop driving it.
- ``protocol``: the answer does not have the shape this client and the contract expect.

Authentication: the admin bearer token goes only on the requests the admin guard requires it
for (``contract.needs_admin``: vLLM's dev/RL endpoints, not the open reads ``/health``,
``/metrics``, ``/refit/ready``), vLLM's ``--api-key`` on ``/v1``. It travels in clear to the
pod's IP: a token sent where none is needed is exposure for nothing.

Fencing (one driver per pod): a client made with ``fence=N`` sends ``X-Refit-Fence: N``
on every path outside ``/v1`` (refit_worker.fence has the pod's rules), and ``before_call``
runs synchronously before every request leaves; whatever it raises reaches the caller
unchanged and nothing is sent (the operator stops there when its lease may have expired).
"""

# The agreed interface takes a per-call `timeout`; it bounds the request itself.
# ruff: noqa: ASYNC109

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from refit_worker import contract
from refit_worker.fence import format_fence

from . import worker_answers as answers
from .worker_answers import WorkerError

# A pod that has not accepted the connection by then is unreachable, not slow.
CONNECT_TIMEOUT_SECONDS = 10.0
# vLLM's RL routes of a broadcast (docs/broadcast.md): like /collective_rpc, a refusal raises
# through vLLM's app, with the worker's RefitRejected text in the body.
TRANSFER_PATHS = frozenset(
    {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
     "/finish_weight_update"}
)  # fmt: skip
# Gauges whose sum is the number of requests a drain still waits for.
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# vLLM's speculative decoding counters: tokens the drafter drafted, and those the target took.
DRAFT_METRICS = (
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
# Tokens each probe prompt decodes greedily to measure a drafter: about 16 drafts of 2 tokens.
DRAFT_PROBE_TOKENS = 32


def session(trace_configs: list[aiohttp.TraceConfig] | None = None) -> aiohttp.ClientSession:
    """The HTTP session for all pods of all fleets (create it inside the event loop). No cap on
    connections overall, since every pod runs its own pass at once; per pod, a pass makes one
    request at a time. Proxies from the environment are ignored (trust_env off): pods are
    reached directly at their pod IPs. A pod's connections are pooled (no force_close), so
    consecutive requests to it, the preflight's and its passes', reuse one connection (an RPC
    too where the pod keeps it after a refusal: see _request); idle ones expire before vLLM
    closes them (contract.CLIENT_KEEPALIVE_SECONDS). ``trace_configs``: aiohttp's request
    tracing (the tests count connections with it)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0, limit_per_host=4, keepalive_timeout=contract.CLIENT_KEEPALIVE_SECONDS
        ),
        trace_configs=trace_configs,
    )


@dataclass(frozen=True)
class Answer:
    """A pod's answer, read in full."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


class WorkerClient:
    """Talks to one pod through ``http``, an aiohttp session the caller owns and shares
    (aiohttp's C HTTP parser costs a fraction of httpx's CPU per request, which bounds how
    fast one operator process drives a thousand pods: bench/results)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: aiohttp.ClientSession,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        fence: int | None = None,
        before_call: Callable[[], None] | None = None,
        keep_rpc_connections: bool = False,
    ) -> None:
        """``fence``: the fencing token sent on every request outside ``/v1`` (0..2**64-1;
        None sends none). ``before_call``: called before every request is sent; what it
        raises propagates unchanged and the request is not sent. ``keep_rpc_connections``:
        the pod keeps a connection open after a refused RPC (its refit_info reports
        contract.CAP_ERRORS_KEEP_CONNECTION), so RPCs share the pooled connection too."""
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._admin_token = admin_token
        self._api_key = api_key
        self._timeout = timeout
        self._fence = None if fence is None else format_fence(fence)  # ValueError if invalid
        self._before_call = before_call
        self._close_after_rpc = not keep_rpc_connections
        self._model: str | None = None
        # The process whose weights the pass probed (GET /refit/ready, read before the
        # probe): the vouch is bound to it. None: not read, or a worker without it.
        self.probed_process: str | None = None

    # --- transport -----------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        params: Mapping[str, Any] | list[tuple[str, Any]] | None = None,
        json: Any = None,
        accept: frozenset[int] = frozenset(),
    ) -> Answer:
        if self._before_call is not None:
            self._before_call()  # may raise: the caller must not act; nothing is sent
        # vLLM's adapter routes sit under /v1 but are admin paths: admin token and fence.
        api = path.startswith("/v1/") and path not in contract.ADAPTER_PATHS
        if api:
            token = self._api_key
        else:
            token = self._admin_token if contract.needs_admin(method, path) else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if self._fence is not None and not api:
            headers[contract.FENCE_HEADER] = self._fence
        if self._close_after_rpc and (path == "/collective_rpc" or path in TRANSFER_PATHS):
            # A pod whose guard does not answer a refusal itself: the refusing RPC raises
            # through vLLM's app, uvicorn closes the connection right after the 500, and a
            # pooled reuse of it races that close (a spurious "connect" error on the next
            # call). Each RPC gets its own connection there. (Marking the connection not to
            # be pooled once the answer is a 500 comes too late: aiohttp has pooled it when
            # the short body arrived with the headers.)
            headers["Connection"] = "close"
        where = f"{method} {path}"
        seconds = self._timeout if timeout is None else timeout
        # `connect` also bounds the wait for a free pooled connection: a request that never
        # left is a connect error, not a timeout (which says the pod may still be working).
        budget = min(seconds, CONNECT_TIMEOUT_SECONDS)
        limits = aiohttp.ClientTimeout(total=seconds, connect=budget, sock_connect=budget)
        try:
            async with self._http.request(
                method,
                self.base_url + path,
                params=params,
                json=json,
                headers=headers,
                timeout=limits,
            ) as response:
                answer = Answer(response.status, await response.read())
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise WorkerError("connect", f"{where}: cannot connect: {exc!r}") from exc
        except TimeoutError as exc:  # connected, sent, no (full) answer in time
            raise WorkerError("timeout", f"{where}: no answer in time ({seconds:g}s)") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise WorkerError("connect", f"{where}: connection lost: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise WorkerError("connect", f"{where}: transport failed: {exc!r}") from exc
        if 200 <= answer.status < 300 or answer.status in accept:
            return answer
        text = answer.text
        rpc = path == "/collective_rpc" or path in TRANSFER_PATHS
        refused = answers.refusal(answer.status, text, rpc=rpc)
        if refused is not None:
            raise refused
        raise WorkerError(
            "http", f"{where}: HTTP {answer.status}: {text[:500]}", status=answer.status
        )

    async def _json(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        params: Mapping[str, Any] | list[tuple[str, Any]] | None = None,
        json: Any = None,
    ) -> Any:
        response = await self._request(method, path, timeout=timeout, params=params, json=json)
        try:
            return response.json()
        except ValueError as exc:
            raise WorkerError(
                "protocol", f"{method} {path}: answer is not JSON: {response.text[:200]!r}"
            ) from exc

    async def _rpc(self, method: str, args: list[Any], timeout: float | None) -> Any:
        """Call a refit_worker extension method; returns the first worker's result."""
        # vLLM bounds the engine-side wait with the body's timeout; keep both in step.
        body = {"method": method, "args": args, "kwargs": {}, "timeout": timeout or self._timeout}
        doc = await self._json("POST", "/collective_rpc", timeout=timeout, json=body)
        return answers.rpc_result(doc, method)

    # --- refit_worker extension RPCs -------------------------------------------------
    async def refit_info(self, *, timeout: float | None = None) -> contract.RefitInfo:
        result = await self._rpc(contract.RPC_INFO, [], timeout)
        try:
            return contract.RefitInfo.from_json_dict(result)
        except contract.ContractError as exc:
            raise WorkerError("protocol", str(exc)) from exc

    async def preflight(self, path: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._rpc_dict(contract.RPC_PREFLIGHT, [path], timeout)

    async def stage(self, path: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._rpc_dict(contract.RPC_STAGE, [path], timeout)

    async def load(
        self, path: str, version: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self._rpc_dict(contract.RPC_LOAD, [path, version], timeout)

    async def probe_reference(
        self, path: str, *, timeout: float | None = None
    ) -> contract.ProbeReference:
        result = await self._rpc(contract.RPC_PROBE_REFERENCE, [path], timeout)
        try:
            return contract.ProbeReference.from_json_dict(result)
        except contract.ContractError as exc:
            raise WorkerError("protocol", str(exc)) from exc

    async def adapter_check(self, path: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Verify a LoRA adapter directory (path rules, manifest, digests, PEFT config)."""
        return await self._rpc_dict(contract.RPC_ADAPTER_CHECK, [path], timeout)

    async def received(
        self, digest: str, version: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """What the pod's transfer engine received and loaded last (refuses unless it loaded
        exactly the manifest ``digest``); records ``version`` as the worker's version."""
        return await self._rpc_dict(contract.RPC_RECEIVED, [digest, version], timeout)

    async def buffer_digests(self, *, timeout: float | None = None) -> tuple[str, dict[str, str]]:
        """(model dtype, {key: SHA-256}) of every module buffer that is not a parameter."""
        where = contract.RPC_BUFFER_DIGESTS
        doc = await self._rpc_dict(where, [], timeout)
        dtype = answers.field(doc, "dtype", str, where)
        return dtype, answers.digests(answers.field(doc, "buffers", dict, where))

    async def _rpc_dict(
        self, method: str, args: list[Any], timeout: float | None
    ) -> dict[str, Any]:
        return answers.rpc_dict(await self._rpc(method, args, timeout), method)

    # --- vLLM dev / RL endpoints -----------------------------------------------------
    async def world_size(self, *, timeout: float | None = None) -> int:
        """How many workers this pod's API server counts (TP x PP x DP): a refit's calls must
        reach every one of them, and a broadcast gives each a rank."""
        doc = await self._json("GET", contract.WORLD_SIZE_PATH, timeout=timeout)
        return answers.world_size(doc)

    async def pause(self, mode: str, *, timeout: float | None = None) -> None:
        doc = await self._json("POST", "/pause", timeout=timeout, params={"mode": mode})
        answers.expect(doc, "status", "paused", "pause")

    async def resume(self, *, timeout: float | None = None) -> None:
        doc = await self._json("POST", "/resume", timeout=timeout)
        answers.expect(doc, "status", "resumed", "resume")

    async def is_paused(self, *, timeout: float | None = None) -> bool:
        doc = await self._json("GET", "/is_paused", timeout=timeout)
        return bool(answers.field(doc, "is_paused", bool, "is_paused"))

    async def sleep(
        self, level: int, *, mode: str | None = None, timeout: float | None = None
    ) -> None:
        params: dict[str, Any] = {"level": level}
        if mode is not None:
            params["mode"] = mode
        doc = await self._json("POST", "/sleep", timeout=timeout, params=params)
        answers.expect(doc, "status", "sleeping", "sleep")

    async def wake_up(self, tags: list[str] | None = None, *, timeout: float | None = None) -> bool:
        """Wake the given tags (all when None); True when the engine is fully awake."""
        params = [("tags", t) for t in tags or []]
        doc = await self._json("POST", "/wake_up", timeout=timeout, params=params)
        return answers.awake(doc)

    async def is_sleeping(self, *, timeout: float | None = None) -> bool:
        doc = await self._json("GET", "/is_sleeping", timeout=timeout)
        return bool(answers.field(doc, "is_sleeping", bool, "is_sleeping"))

    async def reset_prefix_cache(
        self, *, reset_running: bool = False, timeout: float | None = None
    ) -> None:
        """``reset_running``: preempt the requests that hold blocks (a keep drain's frozen
        ones) so that they recompute their prefix on the new weights, instead of a refusal."""
        params = {"reset_running_requests": "true"} if reset_running else None
        doc = await self._json("POST", "/reset_prefix_cache", timeout=timeout, params=params)
        if not answers.field(doc, "success", bool, "reset_prefix_cache"):
            # vLLM refuses while blocks are still held (running requests); a retry may pass.
            raise WorkerError("rejected", "reset_prefix_cache refused: cache blocks still held")

    async def init_weight_transfer(
        self, init_info: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        """Join the trainer's transfer group; answers once every rank has joined."""
        await self._request(
            "POST", "/init_weight_transfer_engine", timeout=timeout, json={"init_info": init_info}
        )

    async def start_weight_update(self, *, timeout: float | None = None) -> None:
        await self._request("POST", "/start_weight_update", timeout=timeout)

    async def update_weights(
        self, update_info: dict[str, Any], *, timeout: float | None = None
    ) -> None:
        """Receive the trainer's send, check it against the manifest and load it; answers
        once that is done (a refusal raises ``rejected`` with the contract's code)."""
        await self._request(
            "POST", "/update_weights", timeout=timeout, json={"update_info": update_info}
        )

    async def finish_weight_update(self, version: str, *, timeout: float | None = None) -> None:
        await self._request(
            "POST", "/finish_weight_update", timeout=timeout, json={"weight_version": version}
        )

    async def update_weight_version(self, version: str, *, timeout: float | None = None) -> None:
        doc = await self._json(
            "POST", "/update_weight_version", timeout=timeout, json={"new_version": version}
        )
        answers.expect(doc, "new_version", version, "update_weight_version")

    async def mark_ready(
        self, version: str, *, process: str | None = None, timeout: float | None = None
    ) -> None:
        """Vouch for the process's weights (``POST /refit/ready``, refit_worker.readiness):
        from now on its readiness probe passes. Only after a passed probe, bound to the
        ``process`` probed (a pod whose process is another one refuses: WorkerError with
        code ProcessChanged)."""
        body = {"version": version} if process is None else {"version": version,
                                                              "process": process}  # fmt: skip
        try:
            doc = await self._json("POST", contract.READY_PATH, timeout=timeout, json=body)
        except WorkerError as e:
            if e.status == 409 and contract.PROCESS_CHANGED in e.message:
                raise WorkerError(
                    "rejected", e.message, status=409, code=contract.PROCESS_CHANGED
                ) from e
            raise
        answers.expect(doc, "version", version, "refit/ready")

    async def process_identity(self, *, timeout: float | None = None) -> str | None:
        """The pod process's identity (``GET /refit/ready``, open, vouched for or not);
        None from a worker image without one."""
        answer = await self._request("GET", contract.READY_PATH, timeout=timeout,
                                     accept=frozenset({404, 503}))  # fmt: skip
        if answer.status == 404:
            return None
        try:
            doc = answer.json()
        except ValueError:
            return None
        process = doc.get("process") if isinstance(doc, dict) else None
        return process if isinstance(process, str) and process else None

    async def weight_checksums(self, *, timeout: float | None = None) -> dict[str, str]:
        """vLLM's own SHA-256 of every parameter each worker holds (``POST /weight_checker``
        ``{"action": "checksum"}``), read after process_weights_after_loading."""
        path = contract.WEIGHT_CHECKER_PATH
        doc = await self._json("POST", path, timeout=timeout, json={"action": "checksum"})
        return answers.digests(answers.field(doc, "checksums", dict, "weight_checker"))

    async def weight_version(self, *, timeout: float | None = None) -> str:
        doc = await self._json("GET", "/weight_info", timeout=timeout)
        return str(answers.field(doc, "weight_version", str, "weight_info"))

    # --- LoRA adapters (vLLM's runtime routes; admin paths behind the guard, fenced) ------
    async def load_adapter(
        self, name: str, path: str, *, inplace: bool = False, timeout: float | None = None
    ) -> None:
        """Load the adapter at ``path`` under ``name``. vLLM refuses a name already loaded
        (HTTP 400) unless ``inplace``, which replaces that adapter's weights under the same
        name; it loads the new weights before dropping the old, so a refused load leaves the
        old adapter serving."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        await self._request("POST", "/v1/load_lora_adapter", timeout=timeout, json=body)

    async def unload_adapter(
        self, name: str, *, timeout: float | None = None, missing_ok: bool = True
    ) -> bool:
        """Unload ``name``; False when it was not loaded (vLLM's 404) and ``missing_ok``."""
        answer = await self._request(
            "POST",
            "/v1/unload_lora_adapter",
            timeout=timeout,
            json={"lora_name": name},
            accept=frozenset({404}) if missing_ok else frozenset(),
        )
        return answer.status != 404

    async def served_models(self, *, timeout: float | None = None) -> list[tuple[str, str | None]]:
        """Every model name the pod serves, as /v1/models lists it: (id, parent), where vLLM
        gives an adapter's card the base model's name as parent and a base model name (one per
        --served-model-name) none (core.admission.ServedModel)."""
        doc = await self._json("GET", "/v1/models", timeout=timeout)
        return answers.served_models(doc)

    async def adapters(self, *, timeout: float | None = None) -> list[str]:
        """The adapter names the pod serves (/v1/models entries other than the base model)."""
        doc = await self._json("GET", "/v1/models", timeout=timeout)
        data = answers.field(doc, "data", list, "models")
        base = await self.model_name(timeout=timeout)
        return [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id") != base]

    # --- OpenAI-compatible endpoints and metrics ---------------------------------------
    async def model_name(self, *, timeout: float | None = None) -> str:
        """The served model name (first entry of /v1/models), asked once per client."""
        if self._model is None:
            doc = await self._json("GET", "/v1/models", timeout=timeout)
            data = answers.field(doc, "data", list, "models")
            if not data:
                raise WorkerError("protocol", "models: the pod serves no model")
            self._model = str(answers.field(data[0], "id", str, "models"))
        return self._model

    async def score(
        self, token_ids: list[int], *, timeout: float | None = None
    ) -> list[float | None]:
        """Teacher-forced logprob of each prompt token; entry 0 is None (nothing before it)."""
        return (await self.score_prompts([token_ids], timeout=timeout))[0]

    async def score_prompts(
        self,
        prompts: list[list[int]],
        *,
        timeout: float | None = None,
        model: str | None = None,
        batch: bool = True,
    ) -> list[list[float | None]]:
        """Teacher-forced logprobs of several prompts in ONE request; ``result[i]`` belongs
        to ``prompts[i]`` and its entry 0 is None (nothing before it).

        vLLM takes a list of token-id lists as the prompt and answers one choice per
        prompt, numbered by ``index``; the choices are matched by that index, not by
        their order, and each must echo the tokens it scored. ``model`` names a LoRA adapter
        to score through (default: the served base model). ``batch=False`` sends one request
        per prompt, as a named adapter always does.
        """
        if not prompts:
            raise ValueError("score_prompts: no prompts to score")
        if (model is not None or not batch) and len(prompts) > 1:
            # On a LoRA-enabled vLLM 0.32 CPU server a batch of prompt-logprob sequences kills
            # the engine core, through an adapter or not (punica_cpu add_lora_logits: einsum
            # sizes; tests/worker/test_lora_adapter.py): one prompt per request there.
            return [
                (await self.score_prompts([p], timeout=timeout, model=model))[0] for p in prompts
            ]
        model = model or await self.model_name(timeout=timeout)  # an adapter: scored through it
        body = {
            "model": model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        doc = await self._json("POST", "/v1/completions", timeout=timeout, json=body)
        return answers.prompt_scores(doc, prompts)

    async def requests_in_flight(self, *, timeout: float | None = None) -> int:
        """Running + waiting requests from /metrics: what a drain still waits for."""
        return answers.in_flight(await self._metric_sums(IN_FLIGHT_METRICS, timeout=timeout))

    async def draft_acceptance(
        self, prompts: list[list[int]], *, timeout: float | None = None, batch: bool = True
    ) -> tuple[float, float]:
        """(drafted, accepted): the tokens a speculative drafter drafted, and those the target
        accepted, while the target decodes ``prompts`` greedily (DRAFT_PROBE_TOKENS each), by
        vLLM's own counters before and after. Meant for a pod out of traffic: other requests
        would move the counters too. ``batch=False``: one request per prompt (LoRA)."""
        before = await self._metric_sums(DRAFT_METRICS, timeout=timeout)
        model = await self.model_name(timeout=timeout)
        for chunk in [prompts] if batch else [[p] for p in prompts]:
            body = {"model": model, "prompt": chunk, "max_tokens": DRAFT_PROBE_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            await self._json("POST", "/v1/completions", timeout=timeout, json=body)
        after = await self._metric_sums(DRAFT_METRICS, timeout=timeout)
        drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
        if not (0 <= accepted <= drafted) or not math.isfinite(drafted):
            raise WorkerError("protocol", f"metrics: {accepted} accepted of {drafted} drafted")
        return drafted, accepted

    async def _metric_sums(
        self, names: tuple[str, ...], *, timeout: float | None = None
    ) -> list[float]:
        """Each sample name's sum over its labels (every engine) on /metrics, in ``names``'
        order; a name the pod does not export is a protocol error."""
        response = await self._request("GET", "/metrics", timeout=timeout)
        return answers.metric_sums(response.text, names)
