"""One simulated pod: its state (what it loaded, its scheduler's pause and the executor's
sleep, its fence), and the steps and faults a test sets on it.

Fencing
    Each pod fences like refit_worker's admin guard, with the same
    :class:`refit_worker.fence.FenceTracker`: a state-changing admin call (POST) whose
    ``X-Refit-Fence`` token is lower than the highest the pod has admitted answers 409 with
    ``{"error": {"code": "StaleFence", "message": ...}}``; a malformed header answers 400;
    no header is admitted and moves nothing; reads are never fenced. A refused call is
    logged (its status is 409 or 400) but reaches no endpoint and no fault. A crash or
    restart forgets the mark, as a restarted container does. Every call log entry has
    ``fence``: the token the call carried (None without the header; the raw text of a
    malformed one); ``state()["fence"]`` is the pod's mark.

Steps and faults
    Faults are set per pod and per step. A step is the endpoint name (``health``, ``refit_ready``,
    ``metrics``, ``models``, ``completions``, ``pause``, ``resume``, ``is_paused``,
    ``sleep``, ``wake_up``, ``is_sleeping``, ``reset_prefix_cache``,
    ``update_weight_version``, ``weight_info``, ``weight_checker``, ``get_world_size``,
    ``load_lora_adapter``, ``unload_lora_adapter``) or the RPC method behind
    ``/collective_rpc`` (``refit_info``, ``refit_preflight``, ``refit_stage``, ``refit_load``,
    ``refit_probe_reference``, ``refit_buffer_digests``, ``refit_adapter_check``).
    One fault per (pod, step); ``times=N`` makes it fire N times and then vanish.

    ========================  ====================================================
    kind (value)              effect
    ========================  ====================================================
    ``error`` (status=500)    answer HTTP ``value``; with ``code=`` on an RPC step the
                              body carries that contract rejection, as vLLM sends it
    ``hang``                  never answer (until the client gives up)
    ``delay`` (seconds)       wait, then answer normally
    ``crash`` (restart_after) reset this connection, stop listening (connection
                              refused); with a value, come back after that many
                              seconds as a freshly started pod
    ``malformed``             answer 200 with an HTML body (a proxy in the way)
    ``wrong_version`` (str)   ``weight_info``/``refit_info`` report this version
    ``refuse``                ``reset_prefix_cache`` answers ``success: false``
    ``nan`` ("nan"|"inf"|..)  ``completions``: every scored logprob is that number
    ``garbage``               ``completions``: random logprobs in [-50, 10]
    ``drift`` (float)         ``completions``: every scored logprob + value
    ``missing``               ``completions``: the actual tokens' entries are absent
    ``skew`` (str)            ``weight_checker`` / ``refit_buffer_digests``: the digest
                              of the parameter / buffer is another (the pod's runtime
                              weights differ from its peers' though it loaded the same)
    ========================  ====================================================

    A fault acts in :meth:`testbed.simworker.server.SimServer._serve` (the kinds any step
    takes) or in the step's route (the others); the fleet's ``set_fault`` sets one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from refit_worker import contract, fence, readiness
from refit_worker.checkpoint import StagedCheckpoint

from testbed.simworker.model import SIM_STALE_DRAFT_RATE, SIM_TOKEN_SECONDS

# The steps a fault is set on: each route's (by path), and the RPC methods behind
# /collective_rpc.
HTTP_STEPS = {
    "/health": "health",
    contract.READY_PATH: "refit_ready",
    "/metrics": "metrics",
    "/v1/models": "models",
    "/v1/completions": "completions",
    "/pause": "pause",
    "/resume": "resume",
    "/is_paused": "is_paused",
    "/sleep": "sleep",
    "/wake_up": "wake_up",
    "/is_sleeping": "is_sleeping",
    "/reset_prefix_cache": "reset_prefix_cache",
    "/update_weight_version": "update_weight_version",
    "/weight_info": "weight_info",
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
    contract.WEIGHT_CHECKER_PATH: "weight_checker",
    contract.WORLD_SIZE_PATH: "get_world_size",
    # vLLM's RL routes a broadcast's receive calls (testbed.simworker.transfer)
    "/init_weight_transfer_engine": "init_weight_transfer_engine",
    "/start_weight_update": "start_weight_update",
    "/update_weights": "update_weights",
    "/finish_weight_update": "finish_weight_update",
    "/collective_rpc": "collective_rpc",
}
RPC_STEPS = (
    contract.RPC_INFO,
    contract.RPC_PREFLIGHT,
    contract.RPC_STAGE,
    contract.RPC_LOAD,
    contract.RPC_PROBE_REFERENCE,
    contract.RPC_BUFFER_DIGESTS,
    contract.RPC_ADAPTER_CHECK,
    contract.RPC_RECEIVED,
)
# vLLM serves its runtime LoRA routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.
LORA_STEPS = frozenset({"load_lora_adapter", "unload_lora_adapter"})
STEPS = tuple(s for s in HTTP_STEPS.values() if s != "collective_rpc") + RPC_STEPS
ANY_STEP_FAULTS = frozenset({"error", "hang", "delay", "crash", "malformed"})
STEP_FAULTS: dict[str, frozenset[str]] = {
    "weight_info": frozenset({"wrong_version"}),
    contract.RPC_INFO: frozenset({"wrong_version"}),
    "reset_prefix_cache": frozenset({"refuse"}),
    "completions": frozenset({"nan", "garbage", "drift", "missing"}),
    "weight_checker": frozenset({"skew"}),
    contract.RPC_BUFFER_DIGESTS: frozenset({"skew"}),
}
# How /pause and /sleep treat the requests in flight (their mode=): PodState.pause.
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class Fault:
    kind: str
    value: Any = None
    code: str | None = None
    times: int | None = None


@dataclass
class PodState:
    ip: str
    allowed_root: str
    admin: bool
    up: bool = True
    weight_version: str = "default"  # what /weight_info reports (update_weight_version)
    loaded_version: str = "default"  # what refit_info reports (last refit_load)
    loaded_path: str = ""
    load_format: str = "dummy"
    seed: str | None = None  # None: dummy weights
    drift: float = 0.0
    weights_discarded: bool = False  # sleep level 2 until the next load
    paused: bool = False  # the scheduler's pause: new requests queue
    frozen: bool = False  # paused with mode keep: requests in flight stop too
    asleep: set[str] = field(default_factory=set)  # the executor's sleeping tags
    aborts: int = 0  # pauses and sleeps with mode abort so far: in-flight requests end
    generating: int = 0  # completions in flight (running), besides ``running``
    running: int = 0
    waiting: int = 0
    capabilities: list[str] | None = None
    unsafe_reasons: list[str] = field(default_factory=list)
    # What /get_world_size counts; more than one (refit_info answers for one worker) is a
    # pod whose other engines the refit's calls would not reach, like vLLM's DP > 1.
    world_size: int = 1
    # The parallel layout refit_info reports (one worker, whatever it says: a pod of another
    # layout, as the operator's admission sees it).
    tensor_parallel_size: int = 1
    staging_budget: str | None = None  # REFIT_STAGING_BUDGET_BYTES's text; None: the env's
    # LoRA: vLLM's --max-lora-rank (0: started without --enable-lora) and whether the runtime
    # routes are served (VLLM_ALLOW_RUNTIME_LORA_UPDATING); refit_info reports both.
    max_lora_rank: int = 0
    runtime_lora_updating: bool = False
    # The adapters loaded: name -> (seed, drift, path), what /v1/models lists and a
    # completion with model=<name> scores through (engine memory: a restart forgets them).
    adapters: dict[str, tuple[str, float, str]] = field(default_factory=dict)
    # A speculative drafter with weights of its own that the worker refits with its target
    # (refit_info.drafter: vLLM's method, "draft_model"; "" for none), the seed of the weights
    # it holds (None: those it started with, drafted for the dummy target it started with),
    # and vLLM's spec-decode counters (/metrics; process memory, as the drafter is).
    drafter: str = ""
    drafter_seed: str | None = None
    drafted: float = 0.0
    accepted: float = 0.0
    staged: StagedCheckpoint | None = None  # what refit_stage holds (process memory)
    # The refit-gloo engine's group and rounds (testbed.simworker.transfer; process memory)
    transfer: Any = None
    faults: dict[str, Fault] = field(default_factory=dict)
    fences: fence.FenceTracker = field(default_factory=fence.FenceTracker)
    ready_mark: readiness.ReadyMark = field(default_factory=readiness.ReadyMark)
    calls: list[dict[str, Any]] = field(default_factory=list)
    transports: set[Any] = field(default_factory=set)
    serving: asyncio.Event = field(default_factory=asyncio.Event)
    stepping: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # set by the next abort
    drained: asyncio.Condition = field(default_factory=asyncio.Condition)

    def reported_capabilities(self) -> list[str]:
        """What refit_info reports: as a test set them, else the required ones, and with
        the admin guard its own (it answers a refused RPC itself: the connection stays)."""
        if self.capabilities is not None:
            return list(self.capabilities)
        guard = [contract.CAP_ADMIN_GUARD, contract.CAP_ERRORS_KEEP_CONNECTION]
        return [*contract.REQUIRED_CAPABILITIES, *(guard if self.admin else [])]

    def fresh(self) -> None:
        """State of a freshly started pod (keeps faults, calls and test-set capabilities)."""
        self.weight_version = self.loaded_version = "default"
        self.loaded_path, self.load_format = "", "dummy"
        self.seed, self.drift, self.weights_discarded = None, 0.0, False
        self.paused, self.frozen, self.running, self.waiting = False, False, 0, 0
        self.generating = 0
        self.asleep = set()
        self.staged = None  # so is what was staged
        self.transfer = None  # and the transfer engine's group and rounds
        self.adapters = {}  # and the adapters loaded
        self.drafter_seed, self.drafted, self.accepted = None, 0.0, 0.0  # its drafter too
        self.fences.reset()  # the mark is process memory
        self.ready_mark.reset()  # and so is the readiness probe's mark
        self.update_serving()

    def draft_rate(self) -> float:
        """The share of its drafts the target accepts while it decodes greedily: all for a
        drafter on the weights trained with the target's (its seed), SIM_STALE_DRAFT_RATE for
        one on others (tests/worker/test_drafter.py measured 1.00 and 0.32-0.46 on vLLM CPU)."""
        fresh = self.drafter_seed == self.seed and not self.weights_discarded
        return 1.0 if fresh else SIM_STALE_DRAFT_RATE

    def draft(self, tokens: int) -> None:
        """A completion decoded ``tokens`` after its first (prefill's): the drafter drafted
        each, and the target accepted its share (greedy decoding: the probe's)."""
        if self.drafter and tokens > 0:
            self.drafted += tokens
            self.accepted += tokens * self.draft_rate()

    def update_serving(self) -> None:
        """``serving``: the scheduler takes new requests; ``stepping``: requests in flight
        make progress (all but a pause with mode keep)."""
        if self.paused:
            self.serving.clear()
        else:
            self.serving.set()
        if self.frozen:
            self.stepping.clear()
        else:
            self.stepping.set()

    def summary(self) -> dict[str, Any]:
        return {
            "ip": self.ip,
            "up": self.up,
            "weight_version": self.weight_version,
            "loaded_version": self.loaded_version,
            "loaded_path": self.loaded_path,
            "dummy": self.seed is None,
            "weights_discarded": self.weights_discarded,
            "paused": self.paused,
            "asleep": sorted(self.asleep),
            "running": self.running,
            "waiting": self.waiting,
            "generating": self.generating,  # requests decoding now (not the /metrics gauges)
            "fence": self.fences.highest,
            "vouched": self.ready_mark.version,  # /refit/ready: None until a pass vouched
            "staged": (
                None
                if self.staged is None
                else {"path": self.staged.path, "mode": self.staged.mode}
            ),
            "adapters": {name: path for name, (_, _, path) in self.adapters.items()},
            "faults": {s: f.__dict__ for s, f in self.faults.items()},
        }

    async def pause(self, mode: str) -> None:
        """vLLM's pause_scheduler: new requests queue from now on; then by mode."""
        self.paused, self.frozen = True, mode == "keep"
        if mode == "abort":
            self.aborts += 1
            self.aborted.set()
            self.aborted = asyncio.Event()
        self.update_serving()
        if mode != "keep":  # wait: once they finished; abort: once their answers went out
            async with self.drained:
                await self.drained.wait_for(lambda: self.generating == 0 or not self.up)

    async def generate(self, max_tokens: int) -> tuple[int, str]:
        """Run one request's decode: (tokens generated, finish reason). A pause or sleep with
        mode abort ends it ("abort"); one with mode keep freezes it until the scheduler
        resumes; with mode wait it runs to the end while new requests queue."""
        aborts = self.aborts
        self.generating += 1
        generated = 1
        try:
            while generated < max_tokens:
                await asyncio.sleep(SIM_TOKEN_SECONDS)
                await self.stepping.wait()
                if self.aborts != aborts:
                    return generated, "abort"
                generated += 1
            return generated, "length"
        finally:
            self.generating -= 1
            async with self.drained:
                self.drained.notify_all()

    def fence_refusal(self, token: int | None, malformed: str | None) -> web.Response | None:
        """The admin guard's fence on an authorized state-changing call: None admits it."""
        if malformed is not None:
            return web.json_response(
                fence.malformed_fence_body(malformed), status=fence.MALFORMED_FENCE_STATUS
            )
        highest = self.fences.highest
        if self.fences.admit(token):
            return None
        assert token is not None and highest is not None  # admit() refuses nothing else
        return web.json_response(
            fence.stale_fence_body(token, highest), status=fence.STALE_FENCE_STATUS
        )
