"""vLLM's own routes, answered as a vLLM 0.32 pod answers them: ``/health``, ``/metrics``,
``/v1/models``, ``/v1/completions`` (a token-id prompt or a list of them,
``prompt_logprobs``), ``/pause``, ``/resume``, ``/is_paused``, ``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/reset_prefix_cache``, ``/update_weight_version``, ``/weight_info``,
the weight checker, ``/get_world_size`` and the runtime LoRA routes
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. The handlers are methods of
:class:`VllmRoutes`, a part of SimServer: the server calls ``on_<step>`` once the call passed
the guard, the fence and the step's fault.

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
    and the rest of a longer request queues like a new one. (The two switches and the decode
    are the pod's: :class:`testbed.simworker.pod.PodState`.)

LoRA adapters (vLLM 0.32 with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)
    Off by default, as a pod started without them: ``SimFleet(max_lora_rank=8,
    runtime_lora_updating=True)`` (or per pod ``set_state``) turns them on, and refit_info
    reports both. Without runtime updating the two routes do not exist (404 ``{"detail": "Not
    Found"}``). They are admin paths (the guard's admin token, fenced) although under /v1.
    ``make_sim_adapter`` (testbed.simworker.model) writes an adapter; a completion with
    ``model=<name>`` of a loaded adapter scores through it. A load answers as vLLM's does: 200
    with the bare text ``Success: LoRA adapter '<name>' added successfully.``; 400 for a name
    already loaded without ``load_inplace`` (which replaces its weights under that name), the
    base model's name, an empty name or path; 404 ``No adapter found`` for a directory that is
    not a loadable adapter (any path: vLLM's engine checks no root; the message's path sanitized
    to ``<path>`` as vLLM does); 500 for a rank above max_lora_rank, and for any load past the
    name checks while max_lora_rank is 0 (the routes served without --enable-lora: measured on
    vLLM 0.32 CPU, "LoRA is not enabled", not compared by the contract test). An unload answers
    200 with ``... removed successfully.`` or 404 for a name not loaded; /v1/models lists each
    adapter (root: its path, parent: the base model); a restart forgets them.
    (``refit_adapter_check``, the extension's check of an adapter before the load:
    testbed.simworker.extension.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from refit_worker import contract
from refit_worker.contract import ADAPTER_CONFIG_FILE

from testbed.simworker.errors import (
    add_lora_failed,
    body_field_missing,
    query_error,
    sanitized,
    vllm_error,
)
from testbed.simworker.model import (
    SIM_ADAPTER_FILE,
    SIM_MAX_MODEL_LEN,
    SIM_MODEL,
    SIM_MODEL_ROOT,
    SIM_RANK_PREFIX,
    SIM_TENSOR,
    SIM_VLLM_VERSION,
    read_sim_weights,
    sim_logprobs,
)
from testbed.simworker.pod import PAUSE_MODES, PodState


def lora_success(text: str) -> web.Response:
    """vLLM answers a successful adapter load or unload with its message as the bare body,
    without a content type; aiohttp names one for any body (application/octet-stream)."""
    return web.Response(body=text.encode())


class VllmRoutes:
    """vLLM's routes: ``on_<step>(request, pod, body, fault)`` answers one call to ``pod``
    (``fault``: the step's fault, or None)."""

    vocab: int  # the server's: token ids from it on are out of vocabulary

    async def on_health(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return web.Response(status=200)

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
        if pod.drafter:  # vLLM's spec-decode counters, exported only with a drafter
            text += (
                "# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.\n"
                "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
                f"vllm:spec_decode_num_draft_tokens_total{labels} {pod.drafted}\n"
                "# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.\n"
                "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
                f"vllm:spec_decode_num_accepted_tokens_total{labels} {pod.accepted}\n"
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
            "max_model_len": SIM_MAX_MODEL_LEN,
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
            if len(ids) >= SIM_MAX_MODEL_LEN:  # vLLM's words, with the one token generated
                return vllm_error(
                    400,
                    f"The decoder prompt (length {len(ids)}) plus the number of requested "
                    f"output tokens (at least 1) is longer than the maximum model length of "
                    f"{SIM_MAX_MODEL_LEN}.",
                    "BadRequestError",
                )
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
            generated, finish = await pod.generate(max_tokens)
            pod.draft((generated - 1) * len(prompts))
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
        await pod.pause(mode)
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
        await pod.pause(mode)
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
            seed, drift = read_sim_weights(directory, SIM_ADAPTER_FILE)
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
