"""Simulated workers in process: testbed/simworker's SimServer (the HTTP double that
tests/worker/test_contract.py holds to real vLLM), served without sockets.

The operator's real WorkerClient talks to them through :class:`InProcessSession`, which
stands in for the aiohttp session: each request becomes an aiohttp Request handed to
``SimServer.dispatch``, so fencing, auth, refusal bodies and faults are the simulator's own.
A request runs as a task of its own: a client that times out stops waiting, the pod's work
goes on (a load that outlives its client). A crashed pod refuses connections.

What the simulator does not keep, the explorer's invariants need: the ground truth of each
pod process (:class:`Truth`): which weights it holds, whether a probe was scored on exactly
those weights, and which fencing tokens its admitted calls carried.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, MultiDict
from refit_worker import contract, fence

from testbed.simworker import (
    RPC_STEPS,
    SIM_MODEL,
    Fault,
    PodState,
    SimServer,
    make_sim_adapter,
    make_sim_checkpoint,
)

# vLLM's RL routes of a broadcast's receive (testbed.simworker.transfer): the engine core's.
TRANSFER_STEPS = (
    "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
)  # fmt: skip
# What vLLM's engine core runs one at a time (utility calls between steps): a call that
# outlives its client still holds the core, and the next one waits for it.
ENGINE_CORE_STEPS = frozenset(RPC_STEPS) | {
    "pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "update_weight_version",
    "weight_checker", *TRANSFER_STEPS,
}  # fmt: skip


@dataclass
class Truth:
    """One pod process as it is, not as the operator believes."""

    generation: int = 0  # bumped whenever the weights change (load, discard, restart)
    probed: int = -1  # the generation a correct probe was last scored on
    process: int = 0  # bumped by every (re)start of the container
    # The LoRA adapters the process holds (a load of a name bumps its generation) and the
    # generation of each that a correct probe through that name last scored.
    adapter_generation: dict[str, int] = field(default_factory=dict)
    adapter_probed: dict[str, int] = field(default_factory=dict)


class _Transport:
    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.ip, 8000) if name in ("sockname", "peername") else default

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


class ExplorerSimServer(SimServer):
    """SimServer without sockets, with the ground truth of every pod process.

    ``on_call(ip, step, token, admitted)`` is called for every fenced call a pod admits,
    before it acts: the explorer checks one driver per pod there."""

    def __init__(self, ips: list[str], allowed_root: str, admin_token: str | None) -> None:
        super().__init__({"ips": ips, "allowed_root": allowed_root, "admin_token": admin_token})
        self.allowed_root = allowed_root
        self.truth = {ip: Truth() for ip in ips}
        self.core: dict[str, asyncio.Lock] = {}  # per process: its engine core
        self.on_call: Callable[[str, str, int], None] = lambda ip, step, token: None
        self.latency: Callable[[str], float] = lambda step: 0.0
        # The kubelet's side of a container that died or came back (restartCount, started).
        self.on_crash: Callable[[str], None] = lambda ip: None
        self.on_restart: Callable[[str], None] = lambda ip: None
        # Per pod: the requests its process is serving. A crash ends them (the process is
        # gone): a late answer never acts on the process that replaced it.
        self.inflight: dict[str, set[asyncio.Task[Any]]] = {}
        # Pods that take LoRA adapters at runtime (explore.py turns it on with the adapter
        # classes; vLLM's --max-lora-rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING).
        self.max_lora_rank = 0
        # Per pod, the next adapter load that goes wrong (``adapter_fail``): "staged" loads
        # the staged name's weights wrong (its staged probe fails, nothing served changed),
        # "swap" the served name's (the probe after the swap fails).
        self.adapter_faults: dict[str, str] = {}
        # The speculative method of the drafter every new pod runs ("" for none; explore.py
        # turns it on with drafter_stale).
        self.drafter = ""
        # Pods whose next load answers 200 but leaves the drafter's weights as they were
        # (drafter_stale): a worker that reloads the target only.
        self.drafter_faults: set[str] = set()

    def add_pod(self, ip: str) -> None:
        self.pods[ip] = PodState(
            ip,
            self.allowed_root,
            self.admin_token is not None,
            max_lora_rank=self.max_lora_rank,
            runtime_lora_updating=self.max_lora_rank > 0,
            drafter=self.drafter,
        )
        self.pods[ip].update_serving()
        self.truth[ip] = Truth()

    async def _listen(self, ip: str) -> None:  # nothing listens: the session dispatches
        return None

    async def _unlisten(self, ip: str) -> None:
        return None

    async def restart(self, pod: PodState) -> None:
        was_up = pod.up
        await super().restart(pod)
        if not was_up:
            self.core[pod.ip] = asyncio.Lock()  # the new process's own core
            t = self.truth[pod.ip]
            t.generation += 1
            t.process += 1
            t.adapter_generation.clear()  # a restart forgets the adapters (PodState.fresh)
            self.on_restart(pod.ip)

    async def crash(self, pod: PodState, restart_after: float | None = None) -> None:
        was_up = pod.up
        me = asyncio.current_task()
        for task in list(self.inflight.pop(pod.ip, set())):
            if task is not me:  # a crash fault's own request answers 503 itself
                task.cancel()
        await super().crash(pod, restart_after)
        self.truth[pod.ip].generation += 1  # the weights died with the process
        if was_up:
            self.on_crash(pod.ip)

    async def _serve(
        self, request: web.Request, pod: PodState, step: str, body: Any
    ) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        serving = self.inflight.setdefault(pod.ip, set())
        serving.add(task)
        try:
            return await self._admitted(request, pod, step, body)
        finally:
            serving.discard(task)

    async def _admitted(
        self, request: web.Request, pod: PodState, step: str, body: Any
    ) -> web.StreamResponse:
        if fence.is_fenced(request.method):  # admitted (a refused call never gets here)
            token = fence.read_fence(request.headers.getall(contract.FENCE_HEADER, []))
            if token is not None:
                self.on_call(pod.ip, step, token)
        await asyncio.sleep(self.latency(step))
        if step not in ENGINE_CORE_STEPS:
            return await self._act(request, pod, step, body)
        core = self.core.setdefault(pod.ip, asyncio.Lock())
        async with core:
            return await self._act(request, pod, step, body)

    def busy(self, ip: str) -> bool:
        """A call holds the pod's engine core (a hung one holds it until the process dies)."""
        core = self.core.get(ip)
        return core is not None and core.locked()

    async def _act(
        self, request: web.Request, pod: PodState, step: str, body: Any
    ) -> web.StreamResponse:
        if not pod.up:
            return web.Response(status=503)
        truth = self.truth[pod.ip]
        fault = pod.faults.get(step)
        if step == contract.RPC_LOAD and fault is not None and fault.kind == "touch":
            # A load that failed after it touched the model: half-written weights.
            del pod.faults[step]
            pod.weights_discarded = True
            truth.generation += 1
            return self._refusal(request, "LoadFailed", "failed after touching the model")
        before = (pod.seed, pod.drift, pod.weights_discarded)
        drafter = pod.drafter_seed
        response = await super()._serve(request, pod, step, body)
        if step == contract.RPC_LOAD and response.status == 200 and pod.ip in self.drafter_faults:
            self.drafter_faults.discard(pod.ip)
            pod.drafter_seed = drafter
        # A completion reads the weights and changes none: one answered late (the delay
        # fault) spans whatever passes ran meanwhile, whose own calls count their changes.
        changed = step != "completions" and (pod.seed, pod.drift, pod.weights_discarded) != before
        if changed or (step in (contract.RPC_LOAD, "update_weights") and response.status == 200):
            truth.generation += 1
        if step == "load_lora_adapter" and response.status == 200 and isinstance(body, dict):
            self._adapter_loaded(pod, str(body.get("lora_name")), bool(body.get("load_inplace")))
        if step == "completions" and response.status == 200 and pod.up:
            served = body.get("model") if isinstance(body, dict) else None
            adapter = pod.adapters.get(served) if isinstance(served, str) else None
            clean = fault is None or fault.kind == "delay"
            if adapter is not None and served != SIM_MODEL:
                assert isinstance(served, str)
                if clean and adapter[1] == 0.0:
                    truth.adapter_probed[served] = truth.adapter_generation.get(served, 0)
                return response
            good = pod.seed is not None and not pod.weights_discarded and pod.drift == 0.0
            if good and clean:
                truth.probed = truth.generation
        return response

    def _adapter_loaded(self, pod: PodState, name: str, inplace: bool) -> None:
        """A load of ``name`` answered 200: a new generation of that adapter, with weights
        that go wrong where ``adapter_fail`` says so (its probe reference stays right)."""
        truth = self.truth[pod.ip]
        truth.adapter_generation[name] = truth.adapter_generation.get(name, 0) + 1
        fault = self.adapter_faults.get(pod.ip)
        staged = "@" in name and not inplace
        if fault is not None and fault == ("staged" if staged else "swap" if inplace else ""):
            del self.adapter_faults[pod.ip]
            seed, _, path = pod.adapters[name]
            pod.adapters[name] = (seed, 2.0, path)

    @staticmethod
    def _refusal(request: web.Request, code: str, detail: str) -> web.Response:
        from testbed.simworker import rpc_failure

        return rpc_failure(request, str(contract.RefitRejected(code, detail)))

    def set_fault(self, ip: str, step: str, kind: str, **kw: Any) -> None:
        self.pods[ip].faults[step] = Fault(kind, kw.get("value"), kw.get("code"), kw.get("times"))

    def serves(self, ip: str) -> str | None:
        """The version the pod process serves, intact: None when down, dummy or damaged, or
        beside a drafter that does not draft for it."""
        pod = self.pods.get(ip)
        if pod is None or not pod.up or pod.seed is None or pod.weights_discarded:
            return None
        if pod.drift != 0.0 or pod.seed != pod.weight_version:
            return None
        if pod.drafter and pod.draft_rate() < 1.0:
            return None  # beside a stale drafter: its drafts are not the target's
        return pod.seed

    def adapters(self, ip: str) -> dict[str, str | None]:
        """The adapters the process holds, staged names included: name -> the version it
        serves intact under that name (None: loaded wrong)."""
        pod = self.pods.get(ip)
        if pod is None or not pod.up:
            return {}
        return {n: (seed if drift == 0.0 else None) for n, (seed, drift, _) in pod.adapters.items()}

    def adapter_probed(self, ip: str, name: str) -> bool:
        """A correct probe through ``name`` was scored on the adapter loaded under it now."""
        t = self.truth[ip]
        return name in t.adapter_probed and t.adapter_probed[name] == t.adapter_generation.get(name)

    def probed(self, ip: str) -> bool:
        """A correct probe was scored on exactly the weights the process holds now."""
        t = self.truth[ip]
        return t.probed == t.generation


class _Answer:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    async def read(self) -> bytes:
        return self._body


class _Request:
    def __init__(self, session: InProcessSession, method: str, url: str, kw: Any) -> None:
        self.session, self.method, self.url, self.kw = session, method, url, kw

    async def __aenter__(self) -> _Answer:
        return await self.session._send(self.method, self.url, **self.kw)

    async def __aexit__(self, *exc: object) -> None:
        return None


class InProcessSession:
    """What WorkerClient needs of an aiohttp.ClientSession: ``request(...)`` as an async
    context manager whose answer has ``status`` and ``read()``."""

    def __init__(self, server: ExplorerSimServer) -> None:
        self.server = server
        self.tasks: set[asyncio.Task[web.StreamResponse]] = set()

    def request(self, method: str, url: str, **kw: Any) -> _Request:
        return _Request(self, method, url, kw)

    async def _send(
        self,
        method: str,
        url: str,
        *,
        params: Any = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> _Answer:
        parts = urlsplit(url)
        ip = parts.hostname or ""
        pod = self.server.pods.get(ip)
        if pod is None or not pod.up:
            raise aiohttp.ClientOSError(111, f"connect to {ip}: connection refused")
        data = b"" if json is None else jsonlib.dumps(json).encode()
        transport = _Transport(ip)
        hdrs = CIMultiDict(headers or {})
        if data:
            hdrs["Content-Type"] = "application/json"
            hdrs["Content-Length"] = str(len(data))
        request = _InRequest(method, parts.path, params, hdrs, data, transport)
        task = asyncio.ensure_future(self.server.dispatch(request))  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        total = timeout.total if timeout is not None else None
        try:
            response = await asyncio.wait_for(asyncio.shield(task), total)
        except TimeoutError:
            raise  # WorkerClient: "timeout"; the pod's work goes on
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and me is not None and not me.cancelling():
                # the pod's process died while serving it: the connection is lost
                raise aiohttp.ServerDisconnectedError() from None
            raise
        if transport.aborted and response.status == 503:
            raise aiohttp.ServerDisconnectedError()
        body = response.body if isinstance(response, web.Response) else b""
        return _Answer(response.status, bytes(body) if isinstance(body, bytes | bytearray) else b"")

    def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()


class _InRequest:
    """What SimServer reads of an aiohttp Request (building real ones costs a mock each)."""

    def __init__(
        self,
        method: str,
        path: str,
        params: Any,
        headers: CIMultiDict[str],
        body: bytes,
        transport: _Transport,
    ) -> None:
        self.method, self.path, self.headers, self.transport = method, path, headers, transport
        items = params.items() if isinstance(params, dict) else (params or [])
        self.query: MultiDict[str] = MultiDict((k, str(v)) for k, v in items)
        self._body = body

    @property
    def can_read_body(self) -> bool:
        return bool(self._body)

    async def read(self) -> bytes:
        return self._body

    async def json(self) -> Any:
        return jsonlib.loads(self._body)


# An adapter directory without PEFT's adapter_config.json (otherwise whole: weights, manifest
# and probe reference): the worker's adapter check refuses it (AdapterInvalid).
BAD_ADAPTER = "bad"


def adapter_checkpoints(
    root: Path, names: list[str], versions: list[str]
) -> dict[tuple[str, str], str]:
    """(name, version) -> path of a simulated LoRA adapter (made once, like ``checkpoints``),
    and (name, BAD_ADAPTER) -> one without adapter_config.json."""
    from refit_worker.checkpoint import write_manifest
    from refit_worker.contract import ADAPTER_CONFIG_FILE

    out: dict[tuple[str, str], str] = {}
    for name in names:
        for v in [*versions, BAD_ADAPTER]:
            d = root / "lora" / name / v
            if not (d / "refit-manifest.json").exists():
                make_sim_adapter(d, v)
                if v == BAD_ADAPTER:
                    (d / ADAPTER_CONFIG_FILE).unlink()
                    write_manifest(d)  # whole but for the config: only the config is wrong
            out[(name, v)] = str(d)
    return out


def checkpoints(
    root: Path, versions: list[str], *, drafter: bool = False, stale: bool = False
) -> dict[str, str]:
    """version -> path of a simulated checkpoint (made once; a checkpoint never changes).
    ``drafter``: each carries a drafter/ trained with its target (``stale``: with another
    target, as a trainer that wrote last step's drafter would)."""
    out = {}
    where = root / ("drafted-stale" if stale else "drafted") if drafter else root
    for v in versions:
        d = where / v
        if not (d / "refit-manifest.json").exists():
            make_sim_checkpoint(d, v, drafter=(f"{v}-stale" if stale else v) if drafter else None)
        out[v] = str(d)
    return out
