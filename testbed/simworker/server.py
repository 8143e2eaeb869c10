"""SimServer: every pod's address listening on one port, each request dispatched to its pod
(the guard's 401, the fence, the step's fault, then the route), crash and restart, and the
control API the test side drives (:class:`testbed.simworker.fleet.SimFleet`).

Admin endpoints answer 401 without the admin token when the fleet has one; ``/v1`` answers
401 without the api key when it has one; an unknown path answers 404 ``{"detail": "Not
Found"}`` (FastAPI's own answer). Like vLLM behind uvicorn, a failed RPC's connection is
closed shortly after its 500 (a request sent on it meanwhile is lost). A crash resets the
pod's connections and stops its listening (connection refused); a restart listens again as
a freshly started pod (:meth:`testbed.simworker.pod.PodState.fresh`).

The control API (``POST /control/<action>`` on 127.0.0.1, a port of its own) takes a JSON
document whose ``ips`` names the pods (all when None): ``fault``, ``clear_faults``,
``crash``, ``restart``, ``state`` (``set``: the settable fields), ``calls`` (the call logs;
``clear``) and ``pods`` (every pod's summary).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from aiohttp import web
from refit_worker import contract, fence
from refit_worker.contract import API_KEY_PREFIXES, needs_admin

from testbed.simworker.errors import SERVING, doomed, rpc_failure, vllm_error
from testbed.simworker.extension import ExtensionRoutes
from testbed.simworker.model import SIM_VOCAB
from testbed.simworker.pod import (
    ANY_STEP_FAULTS,
    HTTP_STEPS,
    LORA_STEPS,
    RPC_STEPS,
    STEP_FAULTS,
    STEPS,
    Fault,
    PodState,
)
from testbed.simworker.routes import VllmRoutes
from testbed.simworker.transfer import Rendezvous, TransferRoutes


class SimServer(VllmRoutes, ExtensionRoutes, TransferRoutes):
    """One simulator process: its pods (``pods``: address -> PodState), their sites and the
    control API. A subclass can serve without sockets (testbed/explorer/workers.py overrides
    ``_listen``, ``_unlisten``, ``crash``, ``restart`` and ``_serve``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.admin_token: str | None = config.get("admin_token")
        self.api_key: str | None = config.get("api_key")
        allowed_root = str(config.get("allowed_root") or "/")
        self.vocab = int(config.get("vocab") or SIM_VOCAB)
        self.pods = {
            ip: PodState(
                ip,
                allowed_root,
                self.admin_token is not None,
                max_lora_rank=int(config.get("max_lora_rank") or 0),
                runtime_lora_updating=bool(config.get("runtime_lora_updating")),
            )
            for ip in config["ips"]
        }
        for pod in self.pods.values():
            pod.update_serving()
        # Broadcast rounds: the rendezvous a trainer in this process opened (transfer.py).
        self.rendezvous: dict[tuple[str, int], Rendezvous] = {}
        self.opened: dict[tuple[str, int], asyncio.Event] = {}
        self.port = 0
        self.sites: dict[str, web.TCPSite] = {}
        self.restart_tasks: set[asyncio.Task[None]] = set()
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        control = web.Application()
        control.router.add_post("/control/{action}", self.control)
        self.control_runner = web.AppRunner(control, access_log=None)

    # --- listening -----------------------------------------------------------------
    async def start(self, port: int) -> tuple[int, int]:
        await self.runner.setup()
        await self.control_runner.setup()
        control_site = web.TCPSite(self.control_runner, "127.0.0.1", 0)
        await control_site.start()
        control_port = control_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ips = list(self.pods)
        for _attempt in range(20):
            self.port = port or self._free_port(ips[0])
            try:
                for ip in ips:
                    await self._listen(ip)
                break
            except OSError:
                if port:
                    raise
                for ip in list(self.sites):
                    await self._unlisten(ip)
        else:
            raise OSError("no port free on every address")
        return self.port, control_port

    @staticmethod
    def _free_port(ip: str) -> int:
        with socket.socket() as s:
            s.bind((ip, 0))
            return int(s.getsockname()[1])

    async def _listen(self, ip: str) -> None:
        site = web.TCPSite(self.runner, ip, self.port, backlog=512, reuse_address=True)
        await site.start()
        self.sites[ip] = site

    async def _unlisten(self, ip: str) -> None:
        site = self.sites.pop(ip, None)
        if site is not None:
            await site.stop()

    async def crash(self, pod: PodState, restart_after: float | None = None) -> None:
        pod.up = False
        pod.fences.reset()
        await self._unlisten(pod.ip)
        for transport in pod.transports:
            transport.abort()
        pod.transports.clear()
        pod.serving.set()  # let queued completions run into the dead connection
        pod.stepping.set()
        if restart_after is not None:
            task = asyncio.create_task(self._restart_later(pod, restart_after))
            self.restart_tasks.add(task)
            task.add_done_callback(self.restart_tasks.discard)

    async def _restart_later(self, pod: PodState, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.restart(pod)

    async def restart(self, pod: PodState) -> None:
        if pod.up:
            return
        pod.fresh()
        await self._listen(pod.ip)
        pod.up = True

    # --- request path --------------------------------------------------------------
    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        ip = transport.get_extra_info("sockname")[0] if transport else None
        pod = self.pods.get(ip or "")
        if pod is None or transport is None:
            return web.Response(status=404)
        if not pod.up or transport in doomed:
            transport.abort()
            return web.Response(status=503)
        SERVING.set(pod)  # this request's task: rpc_failure answers as this pod does
        pod.transports.add(transport)
        if len(pod.transports) > 64:
            pod.transports = {t for t in pod.transports if not t.is_closing()}
        step = HTTP_STEPS.get(request.path)
        body: Any = None
        if step is not None and request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = None
        if step == "collective_rpc" and isinstance(body, dict):
            step = str(body.get("method"))
        given = request.headers.getall(contract.FENCE_HEADER, [])
        malformed: str | None = None
        try:
            token = fence.read_fence(given)
        except fence.FenceError as exc:
            token, malformed = None, str(exc)
        record: dict[str, Any] = {
            "step": step,
            "params": dict(request.query),
            "status": None,
            "fence": token if malformed is None else ", ".join(given),
            # Which credential came along (not its value): the tests hold the operator to
            # sending the admin token only where it is needed, and only to vetted pods.
            "auth": "Authorization" in request.headers,
            # When it arrived and how long the pod took (epoch seconds, the machine's clock):
            # bench/overhead.py splits a refit's time between the pods and the operator.
            "at": time.time(),
        }
        if isinstance(body, dict) and step != "completions":
            record["body"] = body
        if step is not None:
            pod.calls.append(record)
        denied = self._deny(request)
        if (
            denied is None
            and needs_admin(request.method, request.path)
            and fence.is_fenced(request.method)
        ):
            denied = pod.fence_refusal(token, malformed)
        response: web.StreamResponse
        if denied is not None:
            response = denied
        elif step is None or (step in LORA_STEPS and not pod.runtime_lora_updating):
            # no route (vLLM adds the LoRA routes only with runtime updating): FastAPI's answer
            response = web.json_response({"detail": "Not Found"}, status=404)
        else:
            response = await self._serve(request, pod, step, body)
        record["status"] = response.status
        record["seconds"] = time.time() - record["at"]
        return response

    def _deny(self, request: web.Request) -> web.Response | None:
        """401 like refit_worker's admin guard and vLLM's --api-key middleware. The guard
        takes the admin token on vLLM's adapter routes (under /v1) and hands them on with the
        API key; without a guard vLLM's own rule holds there."""
        given = request.headers.get("Authorization", "")
        if needs_admin(request.method, request.path) and self.admin_token is not None:
            want: str | None = self.admin_token
        elif request.path.startswith(API_KEY_PREFIXES):
            want = self.api_key
        else:
            return None
        if want is None or given == f"Bearer {want}":
            return None
        return web.json_response(
            {"error": "Unauthorized"}, status=401, headers={"WWW-Authenticate": "Bearer"}
        )

    async def _serve(
        self, request: web.Request, pod: PodState, step: str, body: Any
    ) -> web.StreamResponse:
        """An admitted call: the step's fault (the kinds any step takes act here), then its
        route, ``on_<step>`` of VllmRoutes or ExtensionRoutes (an RPC method without one
        fails as vLLM's worker does)."""
        fault = pod.faults.get(step)
        if fault is not None and fault.times is not None:
            fault.times -= 1
            if fault.times <= 0:
                del pod.faults[step]
        if fault is not None:
            if fault.kind == "hang":
                await asyncio.Event().wait()
            if fault.kind == "delay":
                await asyncio.sleep(float(fault.value or 0))
            if fault.kind == "crash":
                await self.crash(pod, fault.value)
                return web.Response(status=503)
            if fault.kind == "malformed":
                return web.Response(text="<html>bad gateway</html>", content_type="text/html")
            if fault.kind == "error":
                status = int(fault.value or 500)
                if fault.code is not None:
                    return rpc_failure(
                        request, str(contract.RefitRejected(fault.code, "injected fault"))
                    )
                return vllm_error(status, f"injected fault on {step}", "InternalServerError")
        handler = getattr(self, f"on_{step}", None)
        if handler is None:
            return rpc_failure(request, f"'CPUWorker' object has no attribute '{step}'")
        result: web.StreamResponse = await handler(request, pod, body, fault)
        return result

    # --- control API ---------------------------------------------------------------
    async def control(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        doc = await request.json() if request.can_read_body else {}
        ips = doc.get("ips") or list(self.pods)
        unknown = [ip for ip in ips if ip not in self.pods]
        if unknown:
            return web.json_response({"error": f"unknown pods {unknown[:5]}"}, status=400)
        pods = [self.pods[ip] for ip in ips]
        if action == "fault":
            step, kind = doc.get("step"), doc.get("kind")
            if step not in STEPS:
                return web.json_response({"error": f"unknown step {step!r}"}, status=400)
            if kind not in ANY_STEP_FAULTS | STEP_FAULTS.get(step, frozenset()):
                return web.json_response({"error": f"no fault {kind!r} on {step}"}, status=400)
            code = doc.get("code")
            if code is not None and (code not in contract.REJECTION_CODES or step not in RPC_STEPS):
                return web.json_response(
                    {"error": f"rejection code {code!r} on {step}"}, status=400
                )
            for pod in pods:
                pod.faults[step] = Fault(kind, doc.get("value"), code, doc.get("times"))
        elif action == "clear_faults":
            for pod in pods:
                for step in [doc["step"]] if doc.get("step") else list(pod.faults):
                    pod.faults.pop(step, None)
        elif action == "crash":
            for pod in pods:
                if pod.up:
                    await self.crash(pod, doc.get("restart_after"))
        elif action == "restart":
            for pod in pods:
                await self.restart(pod)
        elif action == "state":
            settable = {
                "running",
                "waiting",
                "weight_version",
                "capabilities",
                "unsafe_reasons",
                "world_size",
                "tensor_parallel_size",
                "staging_budget",
                "max_lora_rank",
                "runtime_lora_updating",
                "drafter",
            }
            bad = set(doc.get("set", {})) - settable
            if bad:
                return web.json_response({"error": f"cannot set {sorted(bad)}"}, status=400)
            for pod in pods:
                for key, value in doc.get("set", {}).items():
                    setattr(pod, key, value)
        elif action == "calls":
            result = {pod.ip: pod.calls for pod in pods}
            if doc.get("clear"):
                for pod in pods:
                    pod.calls = []
            return web.json_response(result)
        elif action != "pods":
            return web.json_response({"error": f"unknown action {action!r}"}, status=404)
        return web.json_response({pod.ip: pod.summary() for pod in pods})
