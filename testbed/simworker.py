"""A simulated vLLM worker fleet: ONE subprocess serving many loopback addresses.

Each simulated pod listens on its own loopback address (127.x.y.z, all on one port) and
answers the endpoints :class:`refit_operator.edges.worker_client.WorkerClient` uses with the
response shapes of a real vLLM 0.32 pod running the refit_worker plugin
(tests/worker/test_contract.py holds the two to the same shapes): ``/health``, ``/refit/ready``,
``/metrics``, ``/v1/models``,
``/v1/completions`` (a token-id prompt or a list of them, ``prompt_logprobs``), ``/pause``,
``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``,
``/update_weight_version``, ``/weight_info``, vLLM's runtime LoRA routes
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, and ``/collective_rpc`` with the
extension's ``refit_info``, ``refit_preflight``, ``refit_stage``, ``refit_load``,
``refit_probe_reference`` and ``refit_adapter_check``.

The simulated model
    A pod starts at weight version ``"default"`` with dummy weights: every token scores
    ln(1/vocab) (``vocab=`` of the fleet, default SIM_VOCAB), as a real dummy-loaded vLLM
    does; larger token ids answer 400. ``make_sim_checkpoint(dir, version, drift=d)``
    writes a checkpoint (one small safetensors file, ``refit-manifest.json`` and
    ``refit-probe.json``) whose "weights" score any token ids with :func:`sim_logprobs` of
    its version, plus ``d`` per token. Its refit-probe.json holds the drift-free scores, so a
    probe against the reference of the checkpoint a pod last loaded passes exactly unless a
    drift or fault is injected. Preflight and load verify the directory with refit_worker's
    own checkpoint module and refuse like the real extension (HTTP 500 whose body carries
    ``refit-rejected: <Code>: <detail>``). ``refit_stage`` stages with the same module
    (checkpoint.stage_checkpoint: the bytes held within the staging budget, every file's
    identity recorded), so ``refit_load`` of the staged path refuses ``CheckpointChanged``
    when a file changed since and loads from the held bytes (``source: "memory"``), from
    disk over the budget (``"disk"``), or after a full check when the path is not staged
    (``"unstaged"``). The budget is the subprocess's ``REFIT_STAGING_BUDGET_BYTES`` (inherited
    from the process that starts the fleet), or per pod ``set_state(staging_budget="1Mi")``
    (the variable's text; None: the environment again). A restart forgets what was staged.
    Admin endpoints answer 401 without the admin token when the fleet has one; ``/v1``
    answers 401 without the api key when it has one; an unknown path answers 404
    ``{"detail": "Not Found"}`` (FastAPI's own answer).

LoRA adapters (vLLM 0.32 with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)
    Off by default, as a pod started without them: ``SimFleet(max_lora_rank=8,
    runtime_lora_updating=True)`` (or per pod ``set_state``) turns them on, and refit_info
    reports both. Without runtime updating the two routes do not exist (404 ``{"detail":
    "Not Found"}``). They are admin paths (the guard's admin token, fenced) although under
    /v1. ``make_sim_adapter(dir, version, drift=d, rank=r)`` writes an adapter (PEFT's
    ``adapter_config.json`` of rank r, one small safetensors file, manifest and probe
    reference); a completion with ``model=<name>`` of a loaded adapter scores
    :func:`sim_logprobs` of its version plus ``d`` (the probe reference is drift-free). A load
    answers as vLLM's does: 200 with the bare text ``Success: LoRA adapter '<name>' added
    successfully.``; 400 for a name already loaded without ``load_inplace`` (which replaces
    its weights under that name), the base model's name, an empty name or path; 404 ``No
    adapter found`` for a directory that is not a loadable adapter (any path: vLLM's engine
    checks no root; the message's path sanitized to ``<path>`` as vLLM does); 500 for a rank
    above max_lora_rank, and for any load past the name checks while max_lora_rank is 0 (the
    routes served without --enable-lora: measured on vLLM 0.32 CPU, "LoRA is not enabled",
    not compared by the contract test). An unload answers 200 with ``... removed
    successfully.`` or 404 for a name not loaded; /v1/models lists each adapter (root: its
    path, parent: the base model); a restart forgets them. ``refit_adapter_check`` verifies
    the directory with refit_worker's own checks and refuses like the real extension
    (PathNotAllowed, CheckpointMissing, ManifestMismatch, ..., AdapterInvalid for a config
    that is not a PEFT LoRA one; AdapterRankTooHigh, AdapterModulesUnknown and
    AdapterBaseMismatch against max_lora_rank and SIM_LORA_MODULES).

Pause, sleep and wake (vLLM 0.32's engine core, held to a real server by the contract test)
    A pod has vLLM's two switches: the scheduler's pause state and the executor's sleeping
    tags. ``/pause?mode=`` pauses the scheduler: new requests queue (they are answered after
    ``/resume``); ``abort`` ends the requests in flight at once (``finish_reason: "abort"``),
    ``wait`` answers only once they finished, ``keep`` freezes them until ``/resume``.
    ``/sleep?level=N&mode=`` pauses the same way; levels 1 and 2 also put the executor to
    sleep (tags ``weights`` and ``kv_cache``); level 0 only pauses. ``/wake_up?tags=`` wakes
    those tags (all without tags; ``scheduling`` names none; a tag that is not asleep wakes
    nothing), and once no tag is asleep it resumes the scheduler, even one paused by
    ``/pause``. ``/is_paused`` is the scheduler's state; ``/is_sleeping`` is true while the
    scheduler is paused or a tag sleeps; ``/resume`` unpauses a sleeping pod's scheduler.
    A completion generates ``max_tokens`` tokens, SIM_TOKEN_SECONDS each after the first (a
    probe's one token costs nothing), and counts as running in /metrics meanwhile; one queued
    behind a pause is not counted (vLLM's gauges change only when its engine steps). A request
    is one sequence here: vLLM's wait drains only the prompts it scheduled (--max-num-seqs),
    and the rest of a longer request queues like a new one.

What a CPU server cannot show (SIM_UNSHOWN; the contract test cannot hold the simulator to it)
    vLLM on CPU ignores sleep in its worker: the weights stay where they are. The simulator
    models the GPU behaviour instead: sleep level 2 discards the weights, so until the next
    successful load every score is garbage. And a LoRA-enabled CPU server's engine dies on a
    completion of several prompt-logprob sequences through an adapter, which the simulator
    scores (as a GPU server does; the client sends such prompts one per request). These,
    and nothing else it serves, are claims about vLLM that no test compares with a real
    server.

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

    Besides faults: ``crash()``/``restart()`` a pod by hand; ``set_state(...)`` sets
    ``running``/``waiting`` (what /metrics reports), ``weight_version``, ``capabilities``,
    ``unsafe_reasons``, ``world_size``, ``tensor_parallel_size``, ``staging_budget``,
    ``max_lora_rank``, ``runtime_lora_updating``; ``calls()`` lists the steps a pod served,
    in order (``call_log()`` with parameters, RPC bodies, fencing tokens, whether an
    ``Authorization`` header came (``auth``) and status codes; ``counts()`` per step);
    ``state()`` shows a pod's state (``staged``: the path and mode refit_stage holds, or
    None; ``adapters``: name -> path). The same methods on ``pods[0].fleet`` (the SimFleet)
    take ``pods=[...]`` and act on every pod when it is None. Like vLLM behind uvicorn, a failed
    RPC's connection is closed shortly after its 500 (a request sent on it meanwhile is lost).

Use (the tests' ``sim_fleet`` fixture starts a :class:`testbed.simfleet.SimFleet` like this and
closes it when the test ends)
    async def test_x(sim_fleet):
        pods = sim_fleet(3, admin_token="t")  # SimFleet(3, admin_token="t").pods
        pods[1].set_fault("refit_load", "error", code="LoadFailed", times=1)
        async with refit_operator.edges.worker_client.session() as http:
            ... WorkerClient(pods[1].base_url, http=http, admin_token="t") ...
        assert pods[1].calls() == ["pause", "sleep", ...]

The subprocess (``python -m testbed.simworker``) reads its configuration as one JSON
line on stdin, prints one JSON line with its ports when every address listens, and exits
when its stdin closes (the process that started it ended, however it ended). The control
API listens on 127.0.0.1 on a port of its own; :class:`testbed.simfleet.SimFleet` is its
Python handle (kept apart: this module is what the subprocess runs, and it starts faster
without the client side's imports).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import math
import os
import random
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from refit_worker import contract, fence, readiness
from refit_worker.checkpoint import (
    STAGING_BUDGET_ENV,
    ExpectedParam,
    StagedCheckpoint,
    load_manifest,
    parse_staging_budget,
    resolve_under_root,
    stage_checkpoint,
    verify_checkpoint,
    verify_params,
    write_manifest,
)
from refit_worker.contract import ADAPTER_CONFIG_FILE, API_KEY_PREFIXES, needs_admin
from refit_worker.lora_adapter import check_adapter
from refit_worker.reference import write_reference

SIM_VOCAB = 512
SIM_MODEL = "sim-model"
SIM_MODEL_ROOT = "/models/sim-model"
SIM_WEIGHTS_FILE = "model.safetensors"
SIM_TENSOR = "sim.weight"
SIM_ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name for an adapter's weights
SIM_ADAPTER_TARGETS = ("q_proj", "v_proj")  # what testbed/tiny_adapter.py targets
# The modules a LoRA may target in the simulated model and their (input, output) features, as
# refit_worker.extension reports a Llama-like model's (packed qkv_proj and gate_up_proj expanded
# into their parts): make_sim_adapter's matrices fit them.
SIM_LORA_MODULES = {
    name: (2, 2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
}
# What the simulated model loads: preflight compares a checkpoint with this.
SIM_PARAMS = {SIM_TENSOR: ExpectedParam(dtype="F32", shape=(2,))}
SIM_VLLM_VERSION = "0.32.0+sim"
SIM_TOKEN_SECONDS = 0.0025  # per generated token after the first
# Behaviours of real vLLM that the simulator models but a vLLM CPU server cannot show, so
# tests/worker/test_contract.py cannot compare them (see the module docstring).
SIM_UNSHOWN = {
    "sleep level 2 discards the weights (scores are garbage until the next load)": (
        "vLLM's CPU worker ignores sleep: its weights survive every level"
    ),
    "several prompts in one completions request through a LoRA adapter are scored": (
        "on a LoRA-enabled vLLM 0.32 CPU server such a batch of prompt-logprob sequences "
        "kills the engine (punica_cpu add_lora_logits); the client sends one per request"
    ),
}

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
# The simulated model's tensors as vLLM's weight checker keys them (one worker, rank 0).
SIM_RANK_PREFIX = "dp0:pp0:pcp0:tp0:"
SIM_BUFFER = "sim.rotary_cache"
PAUSE_MODES = ("abort", "wait", "keep")


# ---------------------------------------------------------------------------------------
# The simulated model and its checkpoints
# ---------------------------------------------------------------------------------------
def sim_logprobs(seed: str, token_ids: list[int] | tuple[int, ...]) -> list[float | None]:
    """The simulated model's teacher-forced logprobs: deterministic in (seed, tokens)."""
    out: list[float | None] = [None]
    for i in range(1, len(token_ids)):
        key = f"{seed}|{i}|{token_ids[i - 1]}|{token_ids[i]}".encode()
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
        out.append(-0.5 - 7.5 * u)
    return out


def make_sim_checkpoint(
    dir: Path, version: str, *, drift: float = 0.0, prompts: int = 3, length: int = 24
) -> Path:
    """Write a checkpoint directory the simulator loads (weights, manifest, probe reference).

    ``drift`` is added to every logprob a pod scores after loading it; the reference in
    refit-probe.json stays drift-free, so a non-zero drift makes the probe see it.
    """
    import numpy as np
    from safetensors.numpy import save_file  # only the test process writes checkpoints

    dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {SIM_TENSOR: np.zeros(2, dtype=np.float32)},
        str(dir / SIM_WEIGHTS_FILE),
        metadata={"seed": version, "drift": repr(float(drift))},
    )
    write_manifest(dir)
    _write_sim_probe(dir, version, prompts, length)
    return dir


def make_sim_adapter(
    dir: Path, version: str, *, drift: float = 0.0, rank: int = 8, prompts: int = 3,
    length: int = 24,
) -> Path:  # fmt: skip
    """Write a LoRA adapter directory the simulator loads: its weights (one small safetensors
    file in PEFT's naming), a PEFT ``adapter_config.json`` of rank ``rank``, the manifest and
    the probe reference.

    A completion through the loaded adapter scores any token ids with :func:`sim_logprobs`
    of its version, plus ``drift`` per token; refit-probe.json stays drift-free (as in
    :func:`make_sim_checkpoint`).
    """
    import numpy as np
    from safetensors.numpy import save_file  # only the test process writes adapters

    dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for target in SIM_ADAPTER_TARGETS:
        prefix = f"base_model.model.model.layers.0.self_attn.{target}"
        tensors[f"{prefix}.lora_A.weight"] = np.zeros((rank, 2), dtype=np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.zeros((2, rank), dtype=np.float32)
    save_file(
        tensors,
        str(dir / SIM_ADAPTER_FILE),
        metadata={"seed": version, "drift": repr(float(drift))},
    )
    config = {  # the keys testbed/tiny_adapter.py writes
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": SIM_MODEL_ROOT,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(SIM_ADAPTER_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    write_manifest(dir)
    _write_sim_probe(dir, version, prompts, length)
    return dir


def _write_sim_probe(dir: Path, version: str, prompts: int, length: int) -> None:
    """refit-probe.json: seeded prompts scored drift-free with the version's sim_logprobs."""
    rng = random.Random(version)
    probe_prompts = []
    for _ in range(prompts):
        ids = tuple(rng.randrange(2, SIM_VOCAB) for _ in range(length))
        probe_prompts.append(contract.ProbePrompt(ids, tuple(sim_logprobs(version, ids))))
    reference = contract.ProbeReference(
        version=version, dtype="float32", prompts=tuple(probe_prompts), extra={"tool": "simworker"}
    )
    write_reference(dir, reference)


def _read_sim_weights(directory: Path, name: str = SIM_WEIGHTS_FILE) -> tuple[str, float]:
    """(seed, drift) from the metadata of a checkpoint's (or adapter's) safetensors header."""
    with (directory / name).open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        return _sim_weights(f.read(header_len), name)


def _sim_weights(header: bytes, name: str = SIM_WEIGHTS_FILE) -> tuple[str, float]:
    """(seed, drift) from a safetensors header (the JSON after the length)."""
    meta = json.loads(header).get("__metadata__") or {}
    if "seed" not in meta:
        raise contract.RefitRejected("LoadFailed", f"{name} is not a sim checkpoint")
    return str(meta["seed"]), float(meta.get("drift", 0.0))


def loopback_ips(n: int, start: str = "127.1.0.1") -> list[str]:
    """n loopback addresses from `start` on, skipping .0 and .255 host parts."""
    ips: list[str] = []
    addr = ipaddress.IPv4Address(start)
    while len(ips) < n:
        if addr not in ipaddress.IPv4Network("127.0.0.0/8"):
            raise ValueError(f"ran out of loopback addresses after {len(ips)}")
        if addr.packed[3] not in (0, 255):
            ips.append(str(addr))
        addr += 1
    return ips


# ---------------------------------------------------------------------------------------
# Server side (runs in the subprocess)
# ---------------------------------------------------------------------------------------
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
    staged: StagedCheckpoint | None = None  # what refit_stage holds (process memory)
    faults: dict[str, Fault] = field(default_factory=dict)
    fences: fence.FenceTracker = field(default_factory=fence.FenceTracker)
    ready_mark: readiness.ReadyMark = field(default_factory=readiness.ReadyMark)
    calls: list[dict[str, Any]] = field(default_factory=list)
    transports: set[Any] = field(default_factory=set)
    serving: asyncio.Event = field(default_factory=asyncio.Event)
    stepping: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # set by the next abort
    drained: asyncio.Condition = field(default_factory=asyncio.Condition)

    def fresh(self) -> None:
        """State of a freshly started pod (keeps faults, calls and test-set capabilities)."""
        self.weight_version = self.loaded_version = "default"
        self.loaded_path, self.load_format = "", "dummy"
        self.seed, self.drift, self.weights_discarded = None, 0.0, False
        self.paused, self.frozen, self.running, self.waiting = False, False, 0, 0
        self.generating = 0
        self.asleep = set()
        self.staged = None  # so is what was staged
        self.adapters = {}  # and the adapters loaded
        self.fences.reset()  # the mark is process memory
        self.ready_mark.reset()  # and so is the readiness probe's mark
        self.update_serving()

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


def lora_success(text: str) -> web.Response:
    """vLLM answers a successful adapter load or unload with its message as the bare body,
    without a content type; aiohttp names one for any body (application/octet-stream)."""
    return web.Response(body=text.encode())


# uvicorn logs the traceback of a failed RPC and then closes the connection; a request the
# client sent on it meanwhile is never answered. The simulator keeps that window open.
RPC_FAILURE_CLOSE_DELAY = 0.05
_doomed: set[Any] = set()  # transports that answer nothing more


def rpc_failure(request: web.Request, message: str) -> web.Response:
    """How vLLM answers a /collective_rpc whose worker method raised: the exception passes
    through the app, so uvicorn closes the connection after the 500."""
    transport = request.transport
    if transport is not None:
        _doomed.add(transport)

        def close() -> None:
            _doomed.discard(transport)
            transport.close()

        asyncio.get_running_loop().call_later(RPC_FAILURE_CLOSE_DELAY, close)
    return vllm_error(
        500,
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause",
        "InternalServerError",
    )


class SimServer:
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
        if not pod.up or transport in _doomed:
            transport.abort()
            return web.Response(status=503)
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
            denied = self._fence(pod, token, malformed)
        response: web.StreamResponse
        if denied is not None:
            response = denied
        elif step is None or (step in LORA_STEPS and not pod.runtime_lora_updating):
            # no route (vLLM adds the LoRA routes only with runtime updating): FastAPI's answer
            response = web.json_response({"detail": "Not Found"}, status=404)
        else:
            response = await self._serve(request, pod, step, body)
        record["status"] = response.status
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

    @staticmethod
    def _fence(pod: PodState, token: int | None, malformed: str | None) -> web.Response | None:
        """The admin guard's fence on an authorized state-changing call: None admits it."""
        if malformed is not None:
            return web.json_response(
                fence.malformed_fence_body(malformed), status=fence.MALFORMED_FENCE_STATUS
            )
        highest = pod.fences.highest
        if pod.fences.admit(token):
            return None
        assert token is not None and highest is not None  # admit() refuses nothing else
        return web.json_response(
            fence.stale_fence_body(token, highest), status=fence.STALE_FENCE_STATUS
        )

    async def _serve(
        self, request: web.Request, pod: PodState, step: str, body: Any
    ) -> web.StreamResponse:
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

    # --- endpoints -----------------------------------------------------------------
    async def on_health(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return web.Response(status=200)

    async def on_refit_ready(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        if request.method == "POST":  # a pass vouches (admitted by the guard's rules above)
            raw = await request.read()
            try:
                version = readiness.parse_vouch(raw)
            except readiness.VouchError as exc:
                return web.json_response(
                    readiness.vouch_error_body(str(exc)), status=readiness.BAD_REQUEST_STATUS
                )
            try:
                answer = pod.ready_mark.vouch(version, readiness.vouched_process(raw))
            except readiness.VouchRefused as exc:
                return web.json_response(
                    readiness.vouch_refused_body(str(exc)),
                    status=readiness.PROCESS_CHANGED_STATUS,
                )
            return web.json_response(answer)
        status, answer = pod.ready_mark.answer()
        return web.json_response(answer, status=status)

    async def on_metrics(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        labels = f'{{engine="0",model_name="{SIM_MODEL}"}}'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(pod.running + pod.generating)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(pod.waiting)}\n"
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def on_models(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        created = int(time.time())
        permission = {
            "id": f"modelperm-{pod.ip}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        model = {
            "id": SIM_MODEL,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": SIM_MODEL_ROOT,
            "parent": None,
            "max_model_len": 512,
            "permission": [permission],
        }
        # vLLM's cards of the adapters loaded (ModelCard defaults: no max_model_len).
        cards = [
            {**model, "id": name, "root": path, "parent": SIM_MODEL, "max_model_len": None}
            for name, (_, _, path) in pod.adapters.items()
        ]
        return web.json_response({"object": "list", "data": [model, *cards]})

    async def on_completions(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        if not isinstance(body, dict):
            return vllm_error(400, "request body is not a JSON object", "BadRequestError")
        served = body.get("model")
        adapter = pod.adapters.get(served) if isinstance(served, str) else None
        if served != SIM_MODEL and adapter is None:
            return vllm_error(
                404,
                f"The model `{served}` does not exist. Valid aliases: {SIM_MODEL}.",
                "NotFoundError",
                "model",
            )
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # one prompt of token ids
        if not isinstance(prompts, list) or not prompts:
            # vLLM 0.32's words for an empty list of prompts.
            return vllm_error(400, "You must pass at least one prompt", "BadRequestError")
        if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
            return vllm_error(400, "the simulator scores token-id prompts only", "BadRequestError")
        for ids in prompts:
            if not ids:
                return vllm_error(400, "The decoder prompt cannot be empty", "BadRequestError")
            for t in ids:
                if not 0 <= t < self.vocab:
                    # One bad prompt fails the whole request, as in vLLM.
                    return vllm_error(400, f"Token id {t} is out of vocabulary", "BadRequestError")
        max_tokens = body.get("max_tokens")
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 16
        aborts, aborted = pod.aborts, pod.aborted
        # Paused (or asleep): queued until the scheduler runs. Not in /metrics' waiting: vLLM's
        # gauges change only when the engine steps, and a paused one does not.
        if not pod.serving.is_set():
            waits = [asyncio.ensure_future(e.wait()) for e in (pod.serving, aborted)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        if not pod.up:
            return web.Response(status=503)
        if pod.aborts != aborts:  # vLLM's abort finishes the queued requests too, unrun
            generated, finish = 0, "abort"
        else:
            generated, finish = await self._generate(pod, max_tokens)
        choices = [
            self._choice(pod, i, ids, fault, generated, finish, adapter)
            for i, ids in enumerate(prompts)
        ]
        prompt_tokens = sum(len(ids) for ids in prompts)
        answer = {
            "id": f"cmpl-sim-{random.getrandbits(64):016x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": f"vllm-{SIM_VLLM_VERSION}",
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + generated * len(prompts),
                "completion_tokens": generated * len(prompts),
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return web.json_response(answer)

    @staticmethod
    async def _generate(pod: PodState, max_tokens: int) -> tuple[int, str]:
        """Run one request's decode: (tokens generated, finish reason). A pause or sleep with
        mode abort ends it ("abort"); one with mode keep freezes it until the scheduler
        resumes; with mode wait it runs to the end while new requests queue."""
        aborts = pod.aborts
        pod.generating += 1
        generated = 1
        try:
            while generated < max_tokens:
                await asyncio.sleep(SIM_TOKEN_SECONDS)
                await pod.stepping.wait()
                if pod.aborts != aborts:
                    return generated, "abort"
                generated += 1
            return generated, "length"
        finally:
            pod.generating -= 1
            async with pod.drained:
                pod.drained.notify_all()

    @staticmethod
    async def _pause(pod: PodState, mode: str) -> None:
        """vLLM's pause_scheduler: new requests queue from now on; then by mode."""
        pod.paused, pod.frozen = True, mode == "keep"
        if mode == "abort":
            pod.aborts += 1
            pod.aborted.set()
            pod.aborted = asyncio.Event()
        pod.update_serving()
        if mode != "keep":  # wait: once they finished; abort: once their answers went out
            async with pod.drained:
                await pod.drained.wait_for(lambda: pod.generating == 0 or not pod.up)

    def _choice(
        self,
        pod: PodState,
        index: int,
        ids: list[int],
        fault: Any,
        generated: int = 1,
        finish: str = "length",
        adapter: tuple[str, float, str] | None = None,
    ) -> dict[str, Any]:
        """The completion choice of one prompt: its teacher-forced prompt_logprobs (through
        ``adapter``, a loaded LoRA adapter's (seed, drift, path), when one is named)."""
        scores: list[float | None]
        kind = fault.kind if fault is not None else None
        seed, drift = (pod.seed, pod.drift) if adapter is None else adapter[:2]
        if pod.weights_discarded or kind == "garbage":
            scores = [None] + [random.uniform(-50.0, 10.0) for _ in ids[1:]]
        elif seed is None:
            scores = [None] + [-math.log(self.vocab)] * (len(ids) - 1)
        else:
            scores = [None] + [lp + drift for lp in sim_logprobs(seed, ids)[1:] if lp is not None]
        if kind == "drift":
            scores = [None] + [lp + float(fault.value) for lp in scores[1:] if lp is not None]
        if kind == "nan":
            scores = [None] + [float(fault.value or "nan")] * (len(ids) - 1)
        prompt_logprobs: list[dict[str, Any] | None] = [None]
        for i, tok in enumerate(ids[1:], start=1):
            shown = (tok + 1) % self.vocab if kind == "missing" else tok
            prompt_logprobs.append(
                {str(shown): {"logprob": scores[i], "rank": 1, "decoded_token": f"<{shown}>"}}
            )
        return {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": [ids[-1]] * generated,
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": ids,
            "routed_experts": None,
        }

    async def on_pause(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return query_error("mode", f"Input should be one of {PAUSE_MODES}, not {mode!r}")
        await self._pause(pod, mode)
        return web.json_response({"status": "paused"})

    async def on_resume(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        pod.paused = pod.frozen = False
        pod.update_serving()
        return web.json_response({"status": "resumed"})

    async def on_is_paused(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return web.json_response({"is_paused": pod.paused})

    async def on_sleep(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        text = request.query.get("level", "1")
        level = int(text) if text.lstrip("-").isdigit() else None
        mode = request.query.get("mode", "abort")
        if level is None or not 0 <= level <= 2:
            return query_error("level", f"Input should be an integer from 0 to 2, not {text!r}")
        if mode not in PAUSE_MODES:
            return query_error("mode", f"Input should be one of {PAUSE_MODES}, not {mode!r}")
        # Level 0 pauses the scheduler only; 1 offloads the weights, 2 discards them (GPU
        # only: SIM_UNSHOWN). An executor already asleep stays as it is.
        await self._pause(pod, mode)
        if level >= 1 and "weights" not in pod.asleep:
            pod.asleep = {"weights", "kv_cache"}
            pod.weights_discarded = pod.weights_discarded or level == 2
        return web.json_response({"status": "sleeping", "level": level})

    async def on_wake_up(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        given = request.query.getall("tags", [])
        tags = [t for t in given if t != "scheduling"]
        # The executor wakes only tags that all sleep (else vLLM logs a warning and wakes
        # none); fully awake, the engine resumes its scheduler.
        if pod.asleep and (not given or (tags and set(tags) <= pod.asleep)):
            pod.asleep = pod.asleep - set(tags) if tags else set()
        awake = not pod.asleep
        if awake:
            pod.paused = pod.frozen = False
            pod.update_serving()
        status = "awake" if awake else "sleeping"
        return web.json_response({"status": status, "tags": given or None})

    async def on_get_world_size(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return web.json_response({"world_size": pod.world_size})

    async def on_is_sleeping(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return web.json_response({"is_sleeping": pod.paused or bool(pod.asleep)})

    async def on_reset_prefix_cache(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        refuse = fault is not None and fault.kind == "refuse"
        return web.json_response({"success": not refuse})

    async def on_update_weight_version(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return vllm_error(400, "body.new_version: Field required", "Bad Request")
        pod.weight_version = version
        return web.json_response({"success": True, "new_version": version})

    async def on_weight_info(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        version = pod.weight_version
        if fault is not None and fault.kind == "wrong_version":
            version = str(fault.value or "sim-wrong-version")
        return web.json_response({"weight_version": version})

    async def on_weight_checker(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        """vLLM's weight checker: SHA-256 per parameter of what the pod holds (its loaded
        weights' seed and drift, dummy or discarded), keyed with the worker's rank prefix."""
        action = body.get("action") if isinstance(body, dict) else None
        if action not in ("checksum", "compare", "reset"):
            return vllm_error(400, "body.action: Input should be 'checksum', 'reset' or "
                              "'compare'", "Bad Request")  # fmt: skip
        if action == "reset":
            pod.weights_discarded = True
            return web.json_response({"status": "reset"})
        held = "discarded" if pod.weights_discarded else f"{pod.seed}|{pod.drift}"
        if fault is not None and fault.kind == "skew":
            held += f"|skew:{fault.value}"
        digest = hashlib.sha256(held.encode()).hexdigest()
        checksums = {SIM_RANK_PREFIX + SIM_TENSOR: digest}
        if action == "checksum":
            return web.json_response({"checksums": checksums})
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            return vllm_error(400, "action='compare' requires a 'baseline' object", "Bad Request")
        keys = sorted(k for k in checksums.keys() | baseline.keys()
                      if checksums.get(k) != baseline.get(k))  # fmt: skip
        return web.json_response({"match": not keys, "mismatches": keys})

    async def on_refit_buffer_digests(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def digests(pod: PodState) -> dict[str, Any]:
            held = "rotary" if fault is None else f"rotary|skew:{fault.value}"
            digest = hashlib.sha256(held.encode()).hexdigest()
            return {"dtype": "float32", "buffers": {SIM_RANK_PREFIX + SIM_BUFFER: digest}}

        return await self._rpc(request, pod, body, digests)

    # --- LoRA adapters (vLLM's runtime routes, served only with runtime updating) ----
    async def on_load_lora_adapter(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        """vLLM's load: the name's checks, then the engine reads the adapter (no path rule:
        that is refit_adapter_check's); ``load_inplace`` replaces a loaded name's weights."""
        name, path = (body.get(k) if isinstance(body, dict) else None
                      for k in ("lora_name", "lora_path"))  # fmt: skip
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str):
                return body_field_missing(key, body)
        if not name or not path:
            return vllm_error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name == SIM_MODEL:
            return vllm_error(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
            )
        if not body.get("load_inplace") and name in pod.adapters:
            return vllm_error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if pod.max_lora_rank == 0:  # runtime updating on, LoRA off: the engine refuses
            return add_lora_failed("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        directory = Path(path)
        try:
            config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
            seed, drift = _read_sim_weights(directory, SIM_ADAPTER_FILE)
        except (OSError, ValueError, contract.RefitRejected):
            message = f"Loading lora {name} failed: No adapter found for {path}"
            return vllm_error(404, sanitized(message), "NotFoundError")
        rank = config.get("r") if isinstance(config, dict) else None
        if not isinstance(rank, int) or rank > pod.max_lora_rank:
            return add_lora_failed(
                f"LoRA rank {rank} is greater than max_lora_rank {pod.max_lora_rank}."
            )
        pod.adapters[name] = (seed, drift, path)
        return lora_success(f"Success: LoRA adapter '{name}' added successfully.")

    async def on_unload_lora_adapter(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            return body_field_missing("lora_name", body)
        if not name:
            return vllm_error(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if pod.adapters.pop(name, None) is None:
            return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return lora_success(f"Success: LoRA adapter '{name}' removed successfully.")

    # --- refit_worker extension RPCs ----------------------------------------------
    async def _rpc(
        self, request: web.Request, pod: PodState, body: Any, fn: Callable[..., Any]
    ) -> web.Response:
        args = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        try:
            result = fn(pod, *args, **kwargs)
        except contract.RefitRejected as exc:
            return rpc_failure(request, str(exc))
        except (TypeError, ValueError) as exc:  # a bad argument, a malformed staging budget
            return rpc_failure(request, str(exc))
        return web.json_response({"results": [result]})

    async def on_refit_info(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def info(pod: PodState) -> dict[str, Any]:
            caps = pod.capabilities
            if caps is None:
                caps = list(contract.REQUIRED_CAPABILITIES)
                caps += [contract.CAP_ADMIN_GUARD] if pod.admin else []
            version = pod.loaded_version
            if fault is not None and fault.kind == "wrong_version":
                version = str(fault.value or "sim-wrong-version")
            return contract.RefitInfo(
                vllm_version=SIM_VLLM_VERSION,
                attention_backend="CPU_ATTN",
                kv_cache_dtype="auto",
                cudagraph_mode="NONE",
                capabilities=tuple(caps),
                unsafe_reasons=tuple(pod.unsafe_reasons),
                weight_version=version,
                model=SIM_MODEL_ROOT,
                allowed_root=pod.allowed_root,
                tensor_parallel_size=pod.tensor_parallel_size,
                max_lora_rank=pod.max_lora_rank,
                runtime_lora_updating=pod.runtime_lora_updating,
            ).to_json_dict()

        return await self._rpc(request, pod, body, info)

    async def on_refit_preflight(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return await self._rpc(request, pod, body, self._preflight)

    def _preflight(self, pod: PodState, path: str) -> dict[str, Any]:
        directory, manifest = verify_checkpoint(path, pod.allowed_root)
        verify_params(manifest.tensors, SIM_PARAMS)
        return self._checked(directory, manifest)

    @staticmethod
    def _checked(directory: Path, manifest: contract.Manifest) -> dict[str, Any]:
        return {  # the keys refit_worker.extension answers with
            "path": str(directory),
            "files": len(manifest.files),
            "bytes": sum(f.size for f in manifest.files),
            "tensors": len(manifest.tensors),
            "parameters": len(SIM_PARAMS),
            "shapesChecked": True,
            "tensorParallelSize": 1,
            "seconds": 0.0,
        }

    async def on_refit_adapter_check(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def check(pod: PodState, path: str) -> dict[str, Any]:
            directory, manifest = verify_checkpoint(path, pod.allowed_root)
            fit = check_adapter(  # the extension's own check, over the simulated engine
                directory,
                manifest.tensors,
                max_rank=pod.max_lora_rank,
                modules=SIM_LORA_MODULES if pod.max_lora_rank else {},
            )
            return {  # the keys refit_worker.extension answers with
                **fit,
                "path": str(directory),
                "files": len(manifest.files),
                "bytes": sum(f.size for f in manifest.files),
                "tensors": len(manifest.tensors),
                "seconds": 0.0,
            }

        return await self._rpc(request, pod, body, check)

    async def on_refit_stage(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def stage(pod: PodState, path: str) -> dict[str, Any]:
            text = pod.staging_budget
            budget = parse_staging_budget(
                text if text is not None else os.environ.get(STAGING_BUDGET_ENV)
            )
            previous, pod.staged = pod.staged, None
            staged = stage_checkpoint(path, pod.allowed_root, budget, previous=previous)
            if not staged.reused:
                try:
                    verify_params(staged.manifest.tensors, SIM_PARAMS)
                except contract.RefitRejected:
                    staged.release()
                    raise
                staged.summary = self._checked(staged.directory, staged.manifest)
            pod.staged = staged
            return {
                **staged.summary,
                "staged": staged.mode,
                "budgetBytes": staged.budget,
                "podWorkers": 1,  # one simulated worker: the whole budget is its share
                "note": staged.note(),
            }

        return await self._rpc(request, pod, body, stage)

    async def on_refit_load(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def load(pod: PodState, path: str, version: str) -> dict[str, Any]:
            # As the real extension: any load releases what was staged; only LoadFailed
            # comes after the (simulated) model was touched.
            staged, pod.staged = pod.staged, None
            if staged is not None and staged.path != path:
                staged.release()
                staged = None
            try:
                if not isinstance(version, str) or not version:
                    raise contract.RefitRejected("LoadFailed", "version must be a non-empty string")
                if staged is None:
                    checked = self._preflight(pod, path)
                    pod.seed, pod.drift = _read_sim_weights(Path(checked["path"]))
                    source = "unstaged"
                else:
                    staged.check_before_load(pod.allowed_root)
                    checked = staged.summary
                    if staged.in_memory:
                        data = dict(staged.take_shards())[SIM_WEIGHTS_FILE]
                        header_len = int.from_bytes(data[:8], "little")
                        pod.seed, pod.drift = _sim_weights(data[8 : 8 + header_len])
                        source = "memory"
                    else:
                        pod.seed, pod.drift = _read_sim_weights(staged.directory)
                        source = "disk"
                        try:
                            staged.check_after_load()
                        except contract.RefitRejected:
                            pod.weights_discarded = True  # mixed bytes: garbage scores
                            raise
            finally:
                if staged is not None:
                    staged.release()
            pod.loaded_version, pod.loaded_path = version, path
            pod.weights_discarded = False
            # A dummy-started vLLM switches its load format on the first load from disk.
            switched, pod.load_format = (pod.load_format, "safetensors")
            return {
                **checked,
                "version": version,
                "loadSeconds": 0.0,
                "switchedLoadFormatFrom": switched if switched != "safetensors" else None,
                "source": source,
            }

        return await self._rpc(request, pod, body, load)

    async def on_refit_probe_reference(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def reference(pod: PodState, path: str) -> dict[str, Any]:
            directory = resolve_under_root(path, pod.allowed_root)
            load_manifest(directory)
            try:
                doc = json.loads((directory / contract.PROBE_FILE).read_text())
                return contract.ProbeReference.from_json_dict(doc).to_json_dict()
            except (OSError, ValueError) as exc:  # ContractError is a ValueError
                raise contract.RefitRejected("ProbeReferenceInvalid", str(exc)) from None

        return await self._rpc(request, pod, body, reference)

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


async def _serve_forever(config: dict[str, Any]) -> None:
    server = SimServer(config)
    port, control_port = await server.start(int(config.get("port") or 0))
    print(json.dumps({"port": port, "control_port": control_port}), flush=True)
    # Never outlive the test process, even one killed without a chance to stop us: the
    # parent holds our stdin open, so its end of file means the parent is gone.
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()


def main() -> None:
    config = json.loads(sys.stdin.readline())
    if not os.environ.get("SIMWORKER_NO_UVLOOP"):
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(config))


if __name__ == "__main__":
    main()
